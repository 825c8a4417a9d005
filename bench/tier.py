"""Shared KV tier benchmark: two workers with and without a Redis tier, one restarted midway.

    python -m bench.tier [--model DIR | --shape tiny|wide] [--configs A,B] [--redis-url URL]
        [--kv-cache-mib N] [--json] [--out F] [--plot F]

Each configuration starts two fresh `prefixgate worker` processes side by side and a routing
gateway (bench.routing's `routed_gateway`, its tenants, its pool size: one worker holds `HOLDS`
of the gsp prompts, so evictions happen), under a Redis key prefix of its own, deleted after:

- cache_aware: cache-aware routing, no tier (the baseline);
- cache_aware+tier: cache-aware routing, workers sharing a Redis tier (PREFIXGATE_KV_TIER=redis);
- round_robin+tier: round robin over the same tier.

The trace is bench.routing's two workloads cut into quarters: each quarter sends its quarter of
the gsp calls (in routing's order), then its quarter of every conversation's turns, every
request streamed (TTFT: the client's clock to the first content chunk). After the second
quarter the worker that was sent more prompt tokens is stopped and started again on its port
with the same settings: its pool is empty, the shared tier is not.

Per configuration: cached share of prompt tokens (usage.cached_tokens / prompt_tokens) overall,
by workload and by quarter; TTFT p50/p99; the restarted worker's own cached share (from its
counters in /internal/v1/state) in the quarter before and the quarter after the restart, and
the client-side share of the gsp tenants it served; the tier's traffic (blocks loaded and their
KV bytes, blocks the cost rule left to recompute, sealed bytes and entries it holds at the end,
the calibrated load and compute cost of a block); pool evictions; failures; wall time.

Goals (issue 46), stated met or not from the numbers: after the restart the restarted worker
serves warm (its cached share in the quarter after within 10% of the quarter before), and
cache-aware routing with the shared tier caches at least 1.2x the prompt tokens routing alone
does.

The default model (`--shape wide`: a random Llama of hidden 512, 4 layers, with SmolLM2's
tokenizer) has a small real model's prefill compute per byte of KV, so loading a block pays
from the start, as it does for SmolLM2-135M (a block computes in tens of milliseconds and
loads from Redis in about one). `--shape tiny` is bench.routing's model, whose KV is so cheap
to compute that, as calibrated at a worker's start, a block computes faster than it loads, so
the cost rule recomputes tier hits until the prefill cost the worker fits from its own steps
says otherwise (`tier_traffic.cost_rule` gives both ends): the rule at work, not a fault.
`--model DIR` serves any model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import BENCH_MODEL, emit, fp32_kv_bytes_per_token, machine, percentile
from bench.local_server import tiny_chat_model, wait_until_ready
from bench.local_workers import (
    SIGNING_KEY,
    LocalWorker,
    gateway_context,
    session_certificates,
    stop,
)
from bench.routing import (
    WORKER_SECRET,
    Cluster,
    Conversation,
    Workloads,
    add_workload_options,
    gsp_body,
    kv_cache_bytes,
    routed_gateway,
    workloads_of,
)
from engine.cache.block_hash import BlockHash
from engine.cache.tier.redis_store import RedisStore
from engine.cache.tier.store import CALIBRATION_OWNER
from engine.model.loader import embedded_model_dir
from gateway.workers.remote_engine import RemoteEngine

CONFIGS = {  # name: (routing mode, tier on)
    "cache_aware": ("cache_aware", False),
    "cache_aware+tier": ("cache_aware", True),
    "round_robin+tier": ("round_robin", True),
}
QUARTERS = 4
RESTART_AFTER = 2  # quarters sent before the restart
WARM_WITHIN = 0.10  # the restarted worker's cached share may drop this much (relative)
TIER_GAIN = 1.2  # cache-aware routing + tier over routing alone


@dataclass(frozen=True, slots=True)
class Shape:
    """A random Llama's size (bench.local_server.tiny_chat_model)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int


# bench.routing's model, and one with a small model's prefill compute per byte of KV
# (SmolLM2-135M: about 6 kFLOP per fp32 KV byte; tiny: 0.3; wide: 3).
SHAPES = {"tiny": Shape(64, 128, 2), "wide": Shape(512, 1536, 4)}


@dataclass(frozen=True, slots=True)
class Answer:
    """One streamed completion as the client saw it."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None  # None: no content came (the model stopped at once)
    content: str


@dataclass(frozen=True, slots=True)
class Record:
    """A request of the trace and its answer."""

    workload: str  # "gsp" or "chat"
    tenant: str
    quarter: int
    answer: Answer


@dataclass
class Log:
    """Every request's outcome, and the failures (counted, the run goes on)."""

    records: list[Record] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)

    def fail(self, why: str) -> None:
        with self.lock:
            self.failures.append(why)

    def share(
        self,
        workload: str | None = None,
        quarters: Collection[int] | None = None,
        tenants: Collection[str] | None = None,
    ) -> float | None:
        """Cached share of the prompt tokens of the requests of `workload`, in `quarters`, of
        `tenants` (each None: all); None when there were none."""
        chosen = [
            record.answer
            for record in self.records
            if workload in (None, record.workload)
            and (quarters is None or record.quarter in quarters)
            and (tenants is None or record.tenant in tenants)
        ]
        prompt = sum(answer.prompt_tokens for answer in chosen)
        return round(sum(a.cached_tokens for a in chosen) / prompt, 4) if prompt else None


def stream_chat(client: httpx.Client, key: str, body: dict[str, Any]) -> Answer:
    """Send a chat completion streamed with its usage; time its first content chunk."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, parts, usage = None, [], None
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()[:200]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"streamed error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    parts.append(text)
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(int(usage["prompt_tokens"]), int(cached), ttft, "".join(parts))


class Trace:
    """bench.routing's workloads as one trace in quarters: each quarter is its share of the gsp
    calls, then its share of every conversation's turns (conversations carry on across)."""

    def __init__(self, sizes: Workloads, model: str) -> None:
        self.sizes = sizes
        self.model = model
        self.calls = sizes.gsp_calls()
        self.conversations = [Conversation(index, sizes) for index in range(sizes.conversations)]
        self.broken: set[int] = set()  # conversations that failed a turn: they stop there

    def run_quarter(self, base_url: str, keys: dict[str, str], quarter: int, log: Log) -> None:
        """Send quarter `quarter` (from 0) through the gateway at `base_url`."""
        model = self.model
        calls = len(self.calls)
        gsp = self.calls[quarter * calls // QUARTERS : (quarter + 1) * calls // QUARTERS]
        turns = self.sizes.turns
        chat_turns = range(quarter * turns // QUARTERS, (quarter + 1) * turns // QUARTERS)
        with httpx.Client(base_url=base_url, timeout=120) as client:

            def call(item: tuple[str, list[dict[str, str]]]) -> None:
                tenant, messages = item
                try:
                    answer = stream_chat(client, keys[tenant], gsp_body(model, messages))
                except Exception as error:  # counted and reported, the run goes on
                    log.fail(f"gsp {tenant}: {error}")
                    return
                log.add(Record("gsp", tenant, quarter, answer))

            def talk(conversation: Conversation) -> None:
                for turn in chat_turns:
                    if conversation.index in self.broken:
                        return
                    try:
                        answer = stream_chat(client, keys["chat"], conversation.next_turn(model))
                    except Exception as error:
                        log.fail(f"conversation {conversation.index} turn {turn}: {error}")
                        self.broken.add(conversation.index)
                        return
                    log.add(Record("chat", "chat", quarter, answer))
                    conversation.answered(answer.content)

            with ThreadPoolExecutor(self.sizes.concurrency) as pool:
                list(pool.map(call, gsp))
                list(pool.map(talk, self.conversations))


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What one worker says of itself at a moment (/internal/v1/state)."""

    url: str
    prompt_tokens: dict[str, int]  # by cache owner (a tenant id; "" the public budget)
    cached_tokens: dict[str, int]
    evicted_blocks: int
    tier: dict[str, Any] | None  # describe()["kv_tier"]: cost rule, loaded and recomputed
    root: str
    block_size: int

    def share(self, since: WorkerView | None = None) -> float | None:
        """Cached share of the prompt tokens it was sent (since `since`; None: none)."""
        prompt = self.sent() - (since.sent() if since else 0)
        cached = self.cached() - (since.cached() if since else 0)
        return round(cached / prompt, 4) if prompt else None

    def sent(self) -> int:
        """Prompt tokens of its tenants' requests (the public budget's "" counts them again)."""
        return sum(tokens for owner, tokens in self.prompt_tokens.items() if owner != "")

    def cached(self) -> int:
        return sum(tokens for owner, tokens in self.cached_tokens.items() if owner != "")


def look(worker: LocalWorker) -> WorkerView:
    """The worker's counters now, asked as a gateway asks."""
    response = worker.request(
        "GET", "/internal/v1/state", headers={"Authorization": f"Bearer {WORKER_SECRET}"}
    )
    response.raise_for_status()
    state = response.json()
    owners = state["stats"]["owners"]
    return WorkerView(
        url=worker.url,
        prompt_tokens={owner: s["counters"]["prompt_tokens"] for owner, s in owners.items()},
        cached_tokens={owner: s["counters"]["cached_tokens"] for owner, s in owners.items()},
        evicted_blocks=sum(
            s["counters"]["evicted_own_blocks"] + s["counters"]["evicted_pressure_blocks"]
            for s in owners.values()
        ),
        tier=state["describe"].get("kv_tier"),
        root=state["root"],
        block_size=int(state["block_size"]),
    )


def restart_worker(cluster: Cluster, index: int, stack: ExitStack) -> float:
    """Stop worker `index` (SIGTERM: it drains) and start it again on its port with the same
    command and settings; returns once the gateway routes to it again (seconds taken)."""
    started = time.perf_counter()
    old = cluster.workers[index]
    stop(old.process)
    certificates = session_certificates()
    # bench.local_workers.worker_process picks a free port; a restart needs the same one.
    env = {
        **os.environ, **cluster.worker_environment,
        "PREFIXGATE_WORKER_SECRET": WORKER_SECRET, "PREFIXGATE_WORKER_SIGNING_KEY": SIGNING_KEY,
        **certificates.worker_environment(),
    }  # fmt: skip
    log = cluster.run_dir / f"worker-{urlsplit(old.url).port}-restarted.log"
    with log.open("wb") as output:
        process = subprocess.Popen(old.process.args, env=env, stdout=output, stderr=output)
    stack.callback(stop, process)
    wait_until_ready(old.url, process, log, 180, gateway_context(certificates))
    cluster.workers[index] = LocalWorker(process, old.url, log, certificates)
    engine = cluster.server.gateway.engine
    assert isinstance(engine, RemoteEngine)  # a gateway with workers routes
    workers = engine.workers
    deadline = time.monotonic() + 60
    while True:
        workers.poll_once()
        with workers.lock:
            if all(worker.up for worker in workers.workers.values()):
                return round(time.perf_counter() - started, 2)
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not take the restarted worker back")
        time.sleep(0.2)


def tier_held(redis_url: str, prefix: str, root: str) -> tuple[int, int]:
    """Sealed bytes and entries the shared tier holds under `prefix` for the model `root`."""
    # Only read: the capacity given here (1 byte) is never applied.
    store = RedisStore(redis_url, BlockHash(bytes.fromhex(root)), 1, key_prefix=prefix)
    try:
        usage = store.usage()
    finally:
        store.close()
    held = [u for owner, u in usage.items() if owner != CALIBRATION_OWNER]
    return sum(u.held_bytes for u in held), sum(u.entries for u in held)


def drop_keys(redis_url: str, prefix: str) -> None:
    """Delete every key this run wrote under its prefix."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    finally:
        client.close()


@dataclass(frozen=True, slots=True)
class Setup:
    """What every configuration runs with."""

    model_dir: Path
    model: str
    kv_cache_bytes: int  # each worker's pool
    kv_bytes_per_token: int  # fp32, every layer
    sizes: Workloads
    redis_url: str


@dataclass(frozen=True, slots=True)
class Run:
    """One configuration's run, as measured: every worker view, and what was restarted.

    views[q] holds both workers after q quarters (views[0]: before the first); the restarted
    worker's counters start again from zero when it restarts (after `RESTART_AFTER`)."""

    name: str
    log: Log
    views: list[list[WorkerView]]
    restarted: int  # which worker
    restart_s: float  # from SIGTERM to routed to again
    fresh: WorkerView  # the restarted worker as it came back
    tenant_ids: dict[str, str]  # by slug
    prefix: str  # its Redis key prefix (deleted)
    held: tuple[int, int]  # sealed bytes and entries in the tier at the end
    wall_s: float


def run_config(name: str, setup: Setup, work: Path, say: Callable[[str], None]) -> Run:
    """One configuration on fresh workers and a fresh key prefix: the trace, with a worker
    restarted after its second quarter."""
    mode, tiered = CONFIGS[name]
    prefix = f"bench-tier-{uuid.uuid4().hex[:12]}"
    environment = {"PREFIXGATE_REDIS_KEY_PREFIX": prefix}
    settings: dict[str, Any] = {"redis_key_prefix": prefix}
    if tiered:
        url = setup.redis_url
        environment |= {"PREFIXGATE_KV_TIER": "redis", "PREFIXGATE_KV_TIER_REDIS_URL": url}
        settings |= {"kv_tier": "redis", "kv_tier_redis_url": url}
    tenants = [(slug, "tenant") for slug in setup.sizes.gsp_tenants()] + [("chat", "user")]
    trace, log = Trace(setup.sizes, setup.model), Log()
    say(f"{name}: starting two workers and a gateway")
    try:
        with ExitStack() as stack:
            cluster = stack.enter_context(
                routed_gateway(work, setup.model_dir, setup.kv_cache_bytes, mode, tenants,
                               name=name.replace("+", "-"), environment=environment,
                               settings=settings, side_by_side=True)
            )  # fmt: skip
            started = time.perf_counter()
            views = [[look(worker) for worker in cluster.workers]]
            restart_s, restarted, fresh = 0.0, 0, views[0][0]
            for quarter in range(QUARTERS):
                if quarter == RESTART_AFTER:  # the one that was sent more has more to lose
                    restarted = max((0, 1), key=lambda index: views[-1][index].sent())
                    say(f"{name}: restarting worker {cluster.workers[restarted].url}")
                    restart_s = restart_worker(cluster, restarted, stack)
                    fresh = look(cluster.workers[restarted])
                trace.run_quarter(cluster.server.url, cluster.keys, quarter, log)
                time.sleep(0.3)  # a worker's counters are as of the end of its last step
                views.append([look(worker) for worker in cluster.workers])
                say(f"{name}: quarter {quarter + 1}/{QUARTERS}: cached share "
                    f"{log.share(quarters=[quarter])}, {len(log.failures)} failures")  # fmt: skip
            wall_s = time.perf_counter() - started
            held = (0, 0)
            if tiered:
                time.sleep(1.0)  # offloads are stored in the background
                held = tier_held(setup.redis_url, prefix, views[-1][0].root)
    finally:
        drop_keys(setup.redis_url, prefix)
    return Run(
        name, log, views, restarted, restart_s, fresh, cluster.tenant_ids, prefix, held, wall_s
    )


def report(run: Run, setup: Setup) -> dict[str, Any]:
    """One configuration's numbers."""
    mode, tiered = CONFIGS[run.name]
    log, views, mine = run.log, run.views, run.restarted
    other = 1 - mine
    ttfts = [r.answer.ttft_s * 1000 for r in log.records if r.answer.ttft_s is not None]
    before, at_restart = views[RESTART_AFTER - 1], views[RESTART_AFTER]
    first_after, end = views[RESTART_AFTER + 1], views[-1]
    # The gsp tenants the restarted worker was sent most of before it restarted.
    slugs = {owner: slug for slug, owner in run.tenant_ids.items() if slug != "chat"}
    its_tenants = sorted(
        slugs[owner]
        for owner, tokens in at_restart[mine].prompt_tokens.items()
        if owner in slugs and tokens > at_restart[other].prompt_tokens.get(owner, 0)
    )
    return {
        "routing": mode,
        "tier": "redis" if tiered else "off",
        "redis_key_prefix": run.prefix,
        "requests": len(log.records),
        "prompt_tokens": sum(r.answer.prompt_tokens for r in log.records),
        "cached_tokens": sum(r.answer.cached_tokens for r in log.records),
        "cached_share": log.share(),
        "cached_share_by_workload": {w: log.share(workload=w) for w in ("gsp", "chat")},
        "cached_share_by_quarter": [log.share(quarters=[q]) for q in range(QUARTERS)],
        "ttft_ms": {
            "p50": round(percentile(ttfts, 0.5), 2) if ttfts else None,
            "p99": round(percentile(ttfts, 0.99), 2) if ttfts else None,
            "streamed": len(ttfts),
        },
        "restart": {
            "worker": at_restart[mine].url,
            "seconds": run.restart_s,
            # Every request, client side.
            "all_requests": {
                "quarter_before": log.share(quarters=[RESTART_AFTER - 1]),
                "quarter_after": log.share(quarters=[RESTART_AFTER]),
                "half_before": log.share(quarters=range(RESTART_AFTER)),
                "half_after": log.share(quarters=range(RESTART_AFTER, QUARTERS)),
            },
            # Its own counters: the prompt tokens it was sent in the quarter before the
            # restart and in the one after, and in the halves.
            "restarted_worker": {
                "quarter_before": at_restart[mine].share(since=before[mine]),
                "quarter_after": first_after[mine].share(),
                "half_before": at_restart[mine].share(),
                "half_after": end[mine].share(),
                "prompt_tokens_quarter_after": first_after[mine].sent(),
                # Its tier hits in the quarter after: loaded, or recomputed by the cost rule
                # as it was calibrated when the worker came back.
                **restarted_tier(run.fresh, first_after[mine]),
            },
            "other_worker": {
                "quarter_before": at_restart[other].share(since=before[other]),
                "quarter_after": first_after[other].share(since=at_restart[other]),
            },
            # Client side: the gsp tenants it was sent most of, wherever they went after.
            "restarted_workers_gsp_tenants": {
                "tenants": its_tenants,
                "quarter_before": log.share(quarters=[RESTART_AFTER - 1], tenants=its_tenants),
                "quarter_after": log.share(quarters=[RESTART_AFTER], tenants=its_tenants),
            },
        },
        "tier_traffic": tier_traffic(run, setup),
        "pool_evicted_blocks": [  # per worker, both lives of the restarted one
            end[index].evicted_blocks + (at_restart[index].evicted_blocks if index == mine else 0)
            for index in (0, 1)
        ],
        "failures": len(log.failures),
        "first_failures": log.failures[:3],
        "wall_s": round(run.wall_s, 2),
    }


def restarted_tier(fresh: WorkerView, later: WorkerView) -> dict[str, Any]:
    """The restarted worker's tier hits up to `later`, and its cost rule when it came back."""
    if fresh.tier is None or later.tier is None:
        return {}
    return {
        "tier_loaded_blocks_quarter_after": later.tier["loaded_blocks"],
        "tier_recomputed_blocks_quarter_after": later.tier["recomputed_blocks"],
        "cost_rule_at_restart": {key: fresh.tier[key] for key in _RULE},
    }


_RULE = ("block_load_ms", "block_compute_ms")


def tier_traffic(run: Run, setup: Setup) -> dict[str, Any] | None:
    """The tier's traffic over the whole run, both workers (the restarted one's two lives)."""
    views = run.views
    lives = [views[-1][0], views[-1][1], views[RESTART_AFTER][run.restarted]]
    described = [life.tier for life in lives if life.tier is not None]
    start = views[0][0].tier
    if not described or start is None:
        return None
    loaded = sum(int(tier["loaded_blocks"]) for tier in described)
    recomputed = sum(int(tier["recomputed_blocks"]) for tier in described)
    hits = loaded + recomputed
    return {
        "loaded_blocks": loaded,
        "recomputed_blocks": recomputed,  # tier hits the cost rule left to the prefill
        "loaded_share_of_hits": round(loaded / hits, 4) if hits else None,
        "loaded_kv_bytes": loaded * setup.kv_bytes_per_token * views[-1][0].block_size,
        "held_sealed_bytes": run.held[0],  # written: nothing is evicted from 4 GiB here
        "held_entries": run.held[1],
        # The cost rule's view of one block at a prompt's start, as calibrated when the worker
        # started and at the end (the prefill's cost follows the steps the worker timed).
        "cost_rule": {
            when: {key: tier[key] for key in _RULE}
            for when, tier in (("at_start", start), ("at_end", described[0]))
        },
        "latency_ms": start["latency_ms"],
        "bytes_per_s": start["bytes_per_s"],
    }


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """Issue 46's two goals, from what was measured (met None: a configuration did not run)."""
    tiered, alone = results.get("cache_aware+tier"), results.get("cache_aware")
    warm: dict[str, Any] = {
        "config": "cache_aware+tier",
        "measure": "the restarted worker's own cached share, quarter after vs quarter before",
        "goal": f"after >= {1 - WARM_WITHIN:g} x before",
        "met": None,
    }
    if tiered is not None:
        own = tiered["restart"]["restarted_worker"]
        before, after = own["quarter_before"], own["quarter_after"]
        warm |= {"before": before, "after": after, "met": served_warm(before, after)}
    gain: dict[str, Any] = {
        "measure": "cached share of prompt tokens, cache_aware+tier over cache_aware",
        "goal": f">= {TIER_GAIN:g}",
        "met": None,
    }
    if tiered is not None and alone is not None and alone["cached_share"]:
        ratio = tiered["cached_share"] / alone["cached_share"]
        gain |= {"ratio": round(ratio, 3), "met": ratio >= TIER_GAIN}
    return {"restart_warm": warm, "tier_gain": gain, "why": why(results)}


def served_warm(before: float | None, after: float | None) -> bool | None:
    """Whether a cached share after the restart is within `WARM_WITHIN` of the one before
    (None: one of them had no requests)."""
    if before is None or after is None:
        return None
    return after >= (1 - WARM_WITHIN) * before


def why(results: dict[str, Any]) -> list[str]:
    """What in the numbers limits the tier: the cost rule, an unloaded pool, failures."""
    notes = []
    for name, result in results.items():
        tier = result["tier_traffic"]
        if tier is not None and tier["recomputed_blocks"] > tier["loaded_blocks"]:
            rule = tier["cost_rule"]
            notes.append(
                f"{name}: the cost rule recomputed {tier['recomputed_blocks']} tier hits and "
                f"loaded {tier['loaded_blocks']}; a block at a prompt's start loads in "
                f"{rule['at_start']['block_load_ms']} ms and computes in "
                f"{rule['at_start']['block_compute_ms']} ms as calibrated at start, "
                f"{rule['at_end']['block_compute_ms']} ms at the end"
            )
        own = result["restart"]["restarted_worker"]
        before, after = own["quarter_before"], own["quarter_after"]
        if tier is not None and served_warm(before, after) is False:
            rule = own["cost_rule_at_restart"]
            notes.append(
                f"{name}: the restarted worker cached {after} of its prompt tokens in the quarter "
                f"after, {before} before; there it loaded "
                f"{own['tier_loaded_blocks_quarter_after']} tier blocks and recomputed "
                f"{own['tier_recomputed_blocks_quarter_after']} by the cost rule (as it "
                f"calibrated on restart: load {rule['block_load_ms']} ms, compute "
                f"{rule['block_compute_ms']} ms a block)"
            )
        if result["failures"]:
            notes.append(f"{name}: {result['failures']} requests failed")
        if not sum(result["pool_evicted_blocks"]):
            notes.append(f"{name}: no block was evicted: the pools held the working set")
    return notes


def plot(path: str, results: dict[str, Any]) -> None:
    """Cached share by quarter (the restart marked) and TTFT, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (shares, ttft) = plt.subplots(1, 2, figsize=(10, 3.8))
    quarters = list(range(1, QUARTERS + 1))
    for name, result in results.items():
        values = [v if v is not None else float("nan") for v in result["cached_share_by_quarter"]]
        shares.plot(quarters, values, marker="o", label=name)
    shares.axvline(RESTART_AFTER + 0.5, color="grey", linestyle="--", label="worker restart")
    shares.set_xticks(quarters, [f"Q{q}" for q in quarters])
    shares.set_ylim(0, 1)
    shares.set_ylabel("prompt tokens served from cache")
    shares.set_title("Cached share by quarter of the trace")
    shares.legend(fontsize=8)
    names = list(results)
    width = 0.38
    for offset, key in enumerate(("p50", "p99")):
        values = [results[name]["ttft_ms"][key] or 0.0 for name in names]
        positions = [index + (offset - 0.5) * width for index in range(len(names))]
        bars = ttft.bar(positions, values, width, label=f"TTFT {key}")
        ttft.bar_label(bars, fmt="%.0f", fontsize=8)
    ttft.set_xticks(range(len(names)), names, fontsize=8)
    ttft.set_ylabel("ms (client, streamed)")
    ttft.set_title("Time to first token")
    ttft.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(
    setup: Setup, configs: list[str], say: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Every configuration in turn: {config: report}."""
    with tempfile.TemporaryDirectory() as scratch:
        runs = [run_config(name, setup, Path(scratch), say) for name in configs]
    return {run.name: report(run, setup) for run in runs}


@contextmanager
def model_directory(model: Path | None, shape: str) -> Iterator[tuple[Path, str]]:
    """The model to serve: `model`, else tiny_chat_model of `shape` in a scratch directory."""
    if model is not None:
        yield model, model.name
        return
    name = BENCH_MODEL if shape == "tiny" else f"{BENCH_MODEL}-{shape}"
    with tempfile.TemporaryDirectory() as scratch:
        size = SHAPES[shape]
        directory = tiny_chat_model(
            Path(scratch) / name,
            embedded_model_dir(),
            hidden_size=size.hidden_size,
            intermediate_size=size.intermediate_size,
            num_hidden_layers=size.num_hidden_layers,
        )
        yield directory, name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: --shape)")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="wide",
        help="the random model's shape (default: wide; tiny is bench.routing's)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)",
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("PREFIXGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--kv-cache-mib",
        type=float,
        default=None,
        help="KV pool per worker in MiB (default: bench.routing's)",
    )
    add_workload_options(parser)
    parser.add_argument("--plot", help="write a PNG chart here")
    args = parser.parse_args()
    configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    sizes = workloads_of(args)
    say = (lambda _: None) if args.json else print
    result = measure(args.model, args.shape, sizes, configs, args.redis_url, args.kv_cache_mib, say)
    emit(result, args.json, args.out)
    if not args.json:
        for name, row in result["results"].items():
            print(f"{name}: cached share {row['cached_share']}, by quarter "
                  f"{row['cached_share_by_quarter']}, TTFT p50 {row['ttft_ms']['p50']} ms, "
                  f"{row['failures']} failures")  # fmt: skip
        for name, goal in result["goals"].items():
            if name != "why":
                print(f"goal {name}: {goal}")
        for note in result["goals"]["why"]:
            print(f"why: {note}")
    if args.plot:
        plot(args.plot, result["results"])


def measure(
    model: Path | None, shape: str, sizes: Workloads, configs: list[str], redis_url: str,
    kv_cache_mib: float | None = None, say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:  # fmt: skip
    """The whole bench: its JSON result."""
    with model_directory(model, shape) as (model_dir, name):
        kv_bytes = kv_cache_bytes(model_dir, sizes, kv_cache_mib)
        per_token = fp32_kv_bytes_per_token(model_dir)
        setup = Setup(model_dir, name, kv_bytes, per_token, sizes, redis_url)
        results = run(setup, configs, say)
    return {
        "bench": "tier",
        "machine": machine(),
        "model": name,
        "shape": None if model is not None else {"name": shape, **asdict(SHAPES[shape])},
        "workers": 2,
        "kv_cache_bytes_per_worker": kv_bytes,
        "kv_bytes_per_token": per_token,
        "workloads": sizes.__dict__,
        "quarters": QUARTERS,
        "restart_after_quarter": RESTART_AFTER,
        "results": results,
        "goals": goals(results),
    }


if __name__ == "__main__":
    main()
