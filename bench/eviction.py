"""Eviction by value against LRU: the prompt tokens a skewed multi-tenant trace leaves to
prefill, at pool sizes of 25-100% of its working set.

    python -m bench.eviction [--requests 1500] [--seed 0] [--cost measured|stated]
        [--concurrency 8] [--json] [--out F] [--plot F]

A real `KVCacheManager` is driven as the scheduler drives it, without a model: `match`, `admit`
the prompt past its cached prefix, `commit` it, append the answer, `allocate` and `commit` it,
`free`. Up to `--concurrency` requests are in flight (their blocks are active, not evictable);
a chat's next turn waits for its previous one. Prefill tokens are the prompt tokens not served
from the cache; prefill ms what those tokens cost under the cost model (the tokens and the
positions they attend, as `engine.step_cost` predicts a step).

The trace follows the published characterization of a provider's KV-cache workload that gives
request kinds and reuse: Wang et al., "KVCache Cache in the Wild" (arXiv 2506.02634, 2025),
Alibaba's to-C trace A. There reuse is skewed (10% of the blocks draw 77% of the hits),
single-turn requests sharing a system prompt account for about as much reuse as multi-turn
chats, and an unbounded cache serves about 62% of the prompt tokens. The paper gives no request
shares for trace A, so these are chosen to come close to those figures: 45% single-turn
requests (a system prompt drawn Zipf-like from 8 public ones and 2 of the tenant's own, then a
unique question), 35% chat turns (sessions of 2-12 turns on a system prompt; each turn is the
previous prompt, its answer and a new message, sent after an exponential think time of a
quarter of the trace on average, so sessions interleave), 20% one-off prompts (a pasted
document, never reused). With seed 0 an unbounded cache serves 59% of the prompt tokens, 42%
of its hits single-turn and 58% chat, and 10% of the blocks draw 94% of the hits (more skewed
than trace A, which if anything favours eviction by value). The JSON reports these figures
(`unbounded`) and, at each pool size, the most any policy could save over LRU
(`unbounded_reduction`: the unbounded cache's prefill against LRU's).

Four tenants send 40/30/20/10% of the requests. Budgets, as shares of the pool: quotas 60, 50,
40 and 40% (the public budget 25%); reservations 10% for the two smallest tenants and 5% for
the public budget. After every allocation the bench checks that no owner holds more than its
quota and that no owner outside the allocation lost blocks it held within its reservation; the
count of violations is reported (it must be 0: the bench exits 1 otherwise).

At 25% and 50% the value policy also runs without each of its refinements (leaf preference,
GreedyDual aging), to show what each is worth.

The cost model has the engine's form, a block at index i costs per_token x 16 + per_context x
(the pairs its 16 tokens attend from position 16 i): `--cost measured` calibrates the seeded
tiny Llama (bench.prefix.tiny_llama: hidden 256, 4 layers, fp32) on this machine with the
engine's own calibration (about 2 s); `--cost stated` uses what that calibration gave on
2026-12-06 (2 AMD EPYC threads): per_token 0.03837 ms, per_context 7.0076e-05 ms. Every block
has the same bytes, so the pool here is 1 layer x 1 head x 1 dim: value per byte orders
blocks as the model's bytes would.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from bench.common import emit, machine
from engine.cache.block_hash import BlockHasher
from engine.cache.block_pool import Block, BlockPool, Rank
from engine.cache.budget import Refusal, TenantBudget, owner_of
from engine.cache.cache_request import CacheRequest, request_block_scopes
from engine.cache.eviction import BlockCost, EvictionPolicy
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import CacheScope, Public, Segment, Tenant, User
from engine.step_cost import StepCost, attended_pairs

BLOCK_SIZE = 16
POLICIES: tuple[EvictionPolicy, ...] = ("value", "lru")
POOL_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# Issue 46's goal: >= 15% fewer prefill tokens than LRU at 25-50% of the working set.
GOAL_REDUCTION, GOAL_FRACTION = 0.15, 0.5
STATED_COST = StepCost(fixed_ms=1.86, per_token_ms=0.03837, per_context_ms=7.0076e-05)
VOCAB = 32_000
# Request kinds and their shares of the trace (see the module docstring).
SHARES = {"single_turn": 0.45, "chat": 0.35, "one_off": 0.20}
TENANT_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
QUOTAS = (0.6, 0.5, 0.4, 0.4)
RESERVATIONS = (0.0, 0.0, 0.1, 0.1)
PUBLIC_BUDGET = (0.25, 0.05)
PUBLIC_PROMPTS, TENANT_PROMPTS = 8, 2
MAX_TURNS = 12
# A chat user's mean think time before the next turn (exponential), as a share of the trace.
THINK_SHARE = 0.25

# -- the trace ----------------------------------------------------------------------------------


@dataclass(slots=True)
class TraceRequest:
    """One request of the trace: the cache's view of it (tokens, scopes), its kind, its answer
    and, for a chat's turn, its session (whose turns run one after another)."""

    request: CacheRequest
    kind: str
    answer: list[int]
    session: int = -1


@dataclass(slots=True)
class _Session:
    session_id: int
    tenant: str
    user: User
    system: int  # the first tokens, under the system prompt's scope
    system_scope: CacheScope
    tokens: list[int]  # the conversation so far: system prompt, messages, answers
    turns_left: int


class _TraceMaker:
    """Draws the trace's requests from one seeded generator."""

    def __init__(self, num_requests: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.think_requests = THINK_SHARE * num_requests
        self.tenants = [f"tenant-{index}" for index in range(len(TENANT_WEIGHTS))]
        public = [(self.text(256, 1024), Public("bench")) for _ in range(PUBLIC_PROMPTS)]
        self.systems: dict[str, list[tuple[list[int], CacheScope]]] = {
            tenant: public + [(self.text(256, 1024), Tenant(tenant)) for _ in range(TENANT_PROMPTS)]
            for tenant in self.tenants
        }
        self.popularity = [1.0 / (rank + 1) for rank in range(PUBLIC_PROMPTS + TENANT_PROMPTS)]
        # Sessions waiting for their user's next message: (due at request index, id, session).
        self.waiting: list[tuple[float, int, _Session]] = []

    def text(self, shortest: int, longest: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(shortest, longest))]

    def system_prompt(self, tenant: str) -> tuple[list[int], CacheScope]:
        return self.rng.choices(self.systems[tenant], self.popularity)[0]

    def request(self, index: int) -> TraceRequest:
        kind = self.rng.choices(list(SHARES), list(SHARES.values()))[0]
        if kind == "chat":
            return self.chat_turn(index)
        tenant = self.rng.choices(self.tenants, TENANT_WEIGHTS)[0]
        user = User(tenant, f"user-{index}")
        if kind == "one_off":
            tokens = self.text(256, 2048)
            segments = [Segment(0, len(tokens), user)]
        else:
            system, scope = self.system_prompt(tenant)
            tokens = system + self.text(16, 256)
            segments = [Segment(0, len(system), scope), Segment(len(system), len(tokens), user)]
        request = CacheRequest(f"r{index}", tenant, tokens, segments, user)
        return TraceRequest(request, kind, self.text(32, 128))

    def chat_turn(self, index: int) -> TraceRequest:
        """The next turn of the session whose user is due back first, or the first turn of a
        new session when nobody is due yet."""
        if self.waiting and self.waiting[0][0] <= index:
            _, _, session = heapq.heappop(self.waiting)
            session.tokens += self.text(16, 192)
        else:
            tenant = self.rng.choices(self.tenants, TENANT_WEIGHTS)[0]
            system, scope = self.system_prompt(tenant)
            turns = min(MAX_TURNS, 2 + int(self.rng.expovariate(1 / 3)))
            user = User(tenant, f"user-{index}")
            tokens = system + self.text(32, 256)
            session = _Session(index, tenant, user, len(system), scope, tokens, turns)
        tokens = list(session.tokens)
        segments = [
            Segment(0, session.system, session.system_scope),
            Segment(session.system, len(tokens), session.user),
        ]
        answer = self.text(64, 384)
        session.tokens += answer
        session.turns_left -= 1
        if session.turns_left:  # the user reads the answer and writes again, a while later
            due = index + self.rng.expovariate(1 / self.think_requests)
            heapq.heappush(self.waiting, (due, session.session_id, session))
        request = CacheRequest(f"r{index}", session.tenant, tokens, segments, session.user)
        return TraceRequest(request, "chat", answer, session.session_id)


def make_trace(num_requests: int, seed: int) -> list[TraceRequest]:
    """A seeded trace of single-turn requests on shared system prompts, interleaved chat
    sessions and one-off prompts, in the shares of `SHARES`."""
    maker = _TraceMaker(num_requests, seed)
    return [maker.request(index) for index in range(num_requests)]


# -- one replay -----------------------------------------------------------------------------------


def engine_block_cost(cost: StepCost) -> BlockCost:
    """What recomputing block `index` of a prompt costs under `cost`, priced as the engine
    prices it (`EngineCore._block_cost`)."""

    def block_cost(index: int) -> float:
        return cost.tokens_ms(BLOCK_SIZE, attended_pairs(index * BLOCK_SIZE, BLOCK_SIZE))

    return block_cost


def measured_cost() -> StepCost:
    """The tiny Llama's cost model on this machine, calibrated as an engine calibrates it."""
    from bench.prefix import tiny_llama
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(tiny_llama(4096), EngineConfig(block_size=BLOCK_SIZE, num_blocks=512))
    return engine.step_cost


class _EveryBlockALeaf(BlockPool):
    """Eviction by value without the leaf preference (an ablation): by priority alone."""

    def rank(self, block: Block) -> Rank:
        _, priority, released = super().rank(block)
        return (False, priority, released)


class _NoAging(BlockPool):
    """Eviction by value without GreedyDual's aging (an ablation): the clock stays at 0."""

    def evict(self, block: Block, by_policy: bool = False) -> None:
        super().evict(block)


# The value policy and the same without each of its two refinements.
VARIANTS: dict[str, tuple[EvictionPolicy, type[BlockPool]]] = {
    "value": ("value", BlockPool),
    "lru": ("lru", BlockPool),
    "value_without_leaf_preference": ("value", _EveryBlockALeaf),
    "value_without_aging": ("value", _NoAging),
}


def make_manager(
    num_blocks: int,
    eviction: EvictionPolicy,
    cost: StepCost,
    budgets: bool = True,
    pool_type: type[BlockPool] = BlockPool,
) -> KVCacheManager:
    """A manager over a pool of `num_blocks`, with the bench's budgets as shares of it (or
    none, for the unbounded run)."""
    spec = KVSpec(1, 1, 1, torch.float16, BLOCK_SIZE)
    hasher = BlockHasher(BLOCK_SIZE)
    manager = KVCacheManager(
        pool_type(spec, num_blocks),
        hasher,
        hasher.root("bench-eviction", "", "float16"),
        public_budget=_budget(PUBLIC_BUDGET, num_blocks) if budgets else None,
        eviction=eviction,
        block_cost=engine_block_cost(cost),
    )
    if budgets:
        for index, shares in enumerate(zip(QUOTAS, RESERVATIONS, strict=True)):
            manager.set_budget(f"tenant-{index}", _budget(shares, num_blocks))
    return manager


def _budget(shares: tuple[float, float], num_blocks: int) -> TenantBudget:
    quota, reserved = shares
    return TenantBudget(int(quota * num_blocks), int(reserved * num_blocks))


@dataclass(slots=True)
class Replay:
    """The trace run on one manager, as a scheduler would run it, and what it cost."""

    manager: KVCacheManager
    cost: StepCost
    concurrency: int
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    cached_by_kind: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    quota_violations: int = 0
    reservation_violations: int = 0
    in_flight: OrderedDict[str, TraceRequest] = field(default_factory=OrderedDict)

    def run(self, trace: list[TraceRequest], progress: tqdm[Any] | None = None) -> None:
        for item in trace:
            for request_id, other in list(self.in_flight.items()):
                if item.session >= 0 and other.session == item.session:  # its previous turn
                    self.finish(request_id)
            while len(self.in_flight) >= self.concurrency:
                self.finish(next(iter(self.in_flight)))
            if not self.start(item):
                while self.in_flight:  # the pool is short for now: let the others end
                    self.finish(next(iter(self.in_flight)))
                self.refused += not self.start(item)
            if progress is not None:
                progress.update()
        while self.in_flight:
            self.finish(next(iter(self.in_flight)))

    def start(self, item: TraceRequest) -> bool:
        """Admit a request and compute its prompt; False if the cache refused it."""
        request, manager = item.request, self.manager
        hit = manager.match(request)
        prompt, cached = len(request.prompt_token_ids), hit.cached_tokens
        if not self.checked(request, lambda: manager.admit(hit, prompt - cached)):
            return False
        manager.commit(request.request_id, prompt)
        self.prefill_tokens += prompt - cached
        self.prefill_ms += self.cost.tokens_ms(
            prompt - cached, attended_pairs(cached, prompt - cached)
        )
        self.cached_by_kind[item.kind] += cached
        self.in_flight[request.request_id] = item
        return True

    def finish(self, request_id: str) -> None:
        """Generate the answer (the KV of all its tokens but the last), then free."""
        item = self.in_flight.pop(request_id)
        manager, total = self.manager, len(item.request.prompt_token_ids) + len(item.answer)
        manager.append_tokens(request_id, item.answer)
        if self.checked(item.request, lambda: manager.allocate(request_id, total)):
            manager.commit(request_id, total - 1)
        manager.free(request_id)
        manager.end_step()

    def checked(self, request: CacheRequest, allocate: Callable[[], Refusal | None]) -> bool:
        """Run an allocation, counting broken quotas and reservations; whether it succeeded."""
        manager, pool = self.manager, self.manager.pool
        owners = manager.owners()
        before = {owner: pool.owned(owner) for owner in owners}
        refusal = allocate()
        scopes = request_block_scopes(request, BLOCK_SIZE)
        requesters = {owner_of(scope, request.tenant_id) for scope in scopes}
        requesters |= {request.tenant_id}  # the answer's blocks
        for owner in owners:
            budget = manager.budget(owner)
            self.quota_violations += pool.owned(owner) > budget.quota_blocks
            if owner not in requesters:
                held_within = min(before[owner], budget.reserved_blocks)
                self.reservation_violations += pool.owned(owner) < held_within
        return refusal is None

    @property
    def cached_tokens(self) -> int:
        return self.cached_by_kind.total()


def replay(
    trace: list[TraceRequest],
    num_blocks: int,
    variant: str,
    cost: StepCost,
    concurrency: int,
    progress: tqdm[Any] | None = None,
) -> dict[str, Any]:
    """Run the trace once on a fresh pool of `num_blocks` under one of `VARIANTS`: its
    prefill, evictions and broken guarantees."""
    eviction, pool_type = VARIANTS[variant]
    manager = make_manager(num_blocks, eviction, cost, pool_type=pool_type)
    started = time.perf_counter()
    run = Replay(manager, cost, concurrency)
    run.run(trace, progress)
    manager.pool.check_consistency()
    counters = [manager.counters(owner) for owner in manager.owners()]
    return {
        "prefill_tokens": run.prefill_tokens,
        "cached_tokens": run.cached_tokens,
        "prefill_ms": round(run.prefill_ms, 1),
        "evicted_blocks": sum(c.evicted_blocks for c in counters),
        "evicted_pressure_blocks": sum(c.evicted_pressure_blocks for c in counters),
        "refused_requests": run.refused,
        "violations": run.quota_violations + run.reservation_violations,
        "quota_violations": run.quota_violations,
        "reservation_violations": run.reservation_violations,
        "seconds": round(time.perf_counter() - started, 2),
    }


def unbounded(trace: list[TraceRequest], cost: StepCost, concurrency: int) -> dict[str, Any]:
    """The trace on a pool that never evicts: its working set (unique blocks cached) and the
    least prefill any eviction policy could reach."""
    total_blocks = sum(
        -(-(len(item.request.prompt_token_ids) + len(item.answer)) // BLOCK_SIZE) for item in trace
    )
    run = Replay(make_manager(total_blocks, "lru", cost, budgets=False), cost, concurrency)
    run.run(trace)
    prompt_tokens = sum(len(item.request.prompt_token_ids) for item in trace)
    hits = run.cached_tokens
    return {
        "working_set_blocks": len(run.manager.prefix_cache),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": run.prefill_tokens,
        "hit_ratio": round(hits / prompt_tokens, 4),
        "hits_by_kind": {
            kind: round(n / max(1, hits), 4) for kind, n in run.cached_by_kind.items()
        },
    }


# -- the benchmark ----------------------------------------------------------------------------


def measure(
    trace: list[TraceRequest], cost: StepCost, concurrency: int, shown: bool = True
) -> dict[str, Any]:
    """Both policies at every pool size (and the value policy's ablations at the goal's
    sizes); the working set comes from an unbounded run."""
    ideal = unbounded(trace, cost, concurrency)
    working_set = ideal["working_set_blocks"]
    plans = [
        (fraction, list(VARIANTS) if fraction <= GOAL_FRACTION else list(POLICIES))
        for fraction in POOL_FRACTIONS
    ]
    runs = sum(len(variants) for _, variants in plans) * len(trace)
    sizes = []
    with tqdm(total=runs, desc="replays", file=sys.stderr, disable=not shown) as bar:
        for fraction, variants in plans:
            num_blocks = max(1, round(fraction * working_set))
            entry: dict[str, Any] = {"fraction": fraction, "num_blocks": num_blocks}
            for variant in variants:
                entry[variant] = replay(trace, num_blocks, variant, cost, concurrency, bar)
            lru, value = entry["lru"]["prefill_tokens"], entry["value"]["prefill_tokens"]
            entry["prefill_token_reduction"] = _fewer(value, lru)
            entry["prefill_ms_reduction"] = _fewer(
                entry["value"]["prefill_ms"], entry["lru"]["prefill_ms"]
            )
            # What no policy can beat, and how much of LRU's distance from it value covers.
            entry["unbounded_reduction"] = _fewer(ideal["prefill_tokens"], lru)
            gap = lru - ideal["prefill_tokens"]
            entry["lru_gap_closed"] = round((lru - value) / gap, 4) if gap else 0.0
            sizes.append(entry)
    return {"unbounded": ideal, "pool_sizes": sizes}


def _fewer(tokens: float, baseline: float) -> float:
    """How many fewer than `baseline`, as a share of it."""
    return round(1.0 - tokens / baseline, 4) if baseline else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cost", choices=["measured", "stated"], default="measured")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument("--plot", help="draw prefill tokens by pool size to this PNG file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.concurrency <= 0:
        parser.error("--requests and --concurrency must be positive")

    cost = measured_cost() if args.cost == "measured" else STATED_COST
    trace = make_trace(args.requests, args.seed)
    kinds = Counter(item.kind for item in trace)
    result: dict[str, Any] = {
        "benchmark": "eviction",
        "machine": machine(),
        "requests": args.requests,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "block_size": BLOCK_SIZE,
        "cost": {"source": args.cost, **cost.describe()},
        "request_shares": {kind: round(kinds[kind] / len(trace), 3) for kind in SHARES},
        **measure(trace, cost, args.concurrency, shown=not args.quiet),
        "goal_reduction": GOAL_REDUCTION,
    }
    sizes = result["pool_sizes"]
    result["violations"] = sum(
        entry[variant]["violations"] for entry in sizes for variant in VARIANTS if variant in entry
    )
    small = [entry for entry in sizes if entry["fraction"] <= GOAL_FRACTION]
    result["meets_goal"] = all(e["prefill_token_reduction"] >= GOAL_REDUCTION for e in small)
    if args.plot:
        plot(args.plot, result)
    emit(result, args.json or not args.out, args.out)
    if args.out and not args.json:
        print(table(result))
    if result["violations"]:
        raise SystemExit(f"{result['violations']} quota or reservation violations")
    return result


def table(result: dict[str, Any]) -> str:
    rows = [
        f"{'pool':>6} {'blocks':>7} {'value':>10} {'lru':>10} {'fewer tokens':>13} {'fewer ms':>9}"
    ]
    for entry in result["pool_sizes"]:
        rows.append(
            f"{entry['fraction']:>6.0%} {entry['num_blocks']:>7} "
            f"{entry['value']['prefill_tokens']:>10} {entry['lru']['prefill_tokens']:>10} "
            f"{entry['prefill_token_reduction']:>13.1%} {entry['prefill_ms_reduction']:>9.1%}"
        )
    ideal = result["unbounded"]
    rows.append(
        f"unbounded: {ideal['prefill_tokens']} prefill tokens, hit ratio {ideal['hit_ratio']:.1%}"
    )
    return "\n".join(rows)


def plot(path: str, result: dict[str, Any]) -> None:
    """Prefill tokens under each policy by pool size, the unbounded cache's as a floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["pool_sizes"]
    fractions = [100 * entry["fraction"] for entry in sizes]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for policy in POLICIES:
        tokens = [entry[policy]["prefill_tokens"] / 1e6 for entry in sizes]
        axes.plot(fractions, tokens, marker="o", label=policy)
    floor = result["unbounded"]["prefill_tokens"] / 1e6
    axes.axhline(floor, color="grey", linestyle="--", label="unbounded")
    axes.set_xlabel("pool, % of the working set")
    axes.set_ylabel("prefill tokens (M)")
    axes.set_title("Eviction by value vs LRU")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
