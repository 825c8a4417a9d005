"""Routing benchmark: cache-aware routing against round robin, over two real engine workers.

    python -m bench.routing [--model DIR] [--kv-cache-mib N] [--out F] [--plot F] [--json]

For each routing mode it starts two fresh `prefixgate worker` processes and a gateway routing
to them (SQLite, in this process), then runs two workloads through the gateway's HTTP API:

- gsp: groups of requests that share a system prompt. Each group is a tenant that shares its
  cache tenant-wide; every request adds its own question. Requests of all groups interleave.
- chat: multi-turn conversations, each one user's (private scope); every turn sends the whole
  conversation so far, with the model's own earlier answers.

It reports, per mode and workload, the share of prompt tokens served from cache (the usage's
`cached_tokens` over `prompt_tokens`), how the prompt tokens spread over the workers, failures
and wall time, as one JSON object (and a PNG with --plot). Default model: the tiny random Llama
with SmolLM2's tokenizer, so that the run measures routing, not the CPU; the KV pool per worker
is sized so that one worker cannot hold every group's prompt at once (`HOLDS`).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from bench.common import BENCH_MODEL, emit, machine

if TYPE_CHECKING:  # both import the gateway: only the run needs them
    from bench.local_server import RunningServer
    from bench.local_workers import LocalWorker

T = TypeVar("T")
WORKER_SECRET = "bench-routing-worker-secret"
MODES = ("round_robin", "cache_aware")
# By default a worker's KV pool holds this share of all gsp groups' prompts: one worker cannot
# keep every group cached, two can between them (as a fleet is sized in production).
HOLDS = 0.6
_WORDS = [
    "account", "booking", "cabin", "delay", "flight", "gate", "hotel", "invoice", "journey",
    "luggage", "meal", "network", "offer", "passenger", "queue", "refund", "route", "schedule",
    "seat", "station", "ticket", "transfer", "upgrade", "visa", "weather", "window", "airport",
    "baggage", "carrier", "departure", "arrival", "connection", "policy",
]  # fmt: skip


@dataclass
class Tally:
    """Usage summed over a workload's requests."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details") or {}
        with self.lock:
            self.requests += 1
            self.prompt_tokens += int(usage["prompt_tokens"])
            self.cached_tokens += int(details.get("cached_tokens") or 0)

    def fail(self, why: str) -> None:
        with self.lock:
            self.failures.append(why)

    @property
    def share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def report(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_share": round(self.share, 4),
            "failures": len(self.failures),
            "first_failures": self.failures[:3],
        }


def words(generator: random.Random, count: int) -> str:
    return " ".join(generator.choice(_WORDS) for _ in range(count))


@dataclass(frozen=True)
class Workloads:
    """The sizes of both workloads."""

    groups: int = 8
    per_group: int = 6
    system_words: int = 160
    conversations: int = 8
    turns: int = 5
    turn_words: int = 40
    answer_tokens: int = 16
    concurrency: int = 4
    seed: int = 0

    def gsp_tenants(self) -> list[str]:
        return [f"gsp-{group}" for group in range(self.groups)]

    def gsp_calls(self) -> list[tuple[str, list[dict[str, str]]]]:
        """(tenant, messages) of every gsp request, groups interleaved."""
        generator = random.Random(self.seed)
        prompts = [words(generator, self.system_words) for _ in range(self.groups)]
        calls = [
            (f"gsp-{group}", [
                {"role": "system", "content": prompts[group]},
                {"role": "user", "content": f"Question {index}: {words(generator, 12)}?"},
            ])
            for group in range(self.groups)
            for index in range(self.per_group)
        ]  # fmt: skip
        generator.shuffle(calls)
        return calls


def chat(client: httpx.Client, key: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
    result: dict[str, Any] = response.json()
    return result


def gsp_body(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The request body of one gsp call: a short answer, greedy."""
    return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}


class Conversation:
    """One end user's multi-turn chat: its messages so far, each new turn's words drawn from
    its own seed, so that every run sends the same questions in the same order."""

    def __init__(self, index: int, sizes: Workloads) -> None:
        self.index = index
        self.sizes = sizes
        self._generator = random.Random(sizes.seed * 1000 + index)
        self.messages = [{"role": "system", "content": "You are a concise travel assistant."}]

    def next_turn(self, model: str) -> dict[str, Any]:
        """The request body of the next turn: the whole conversation and a new question."""
        question = words(self._generator, self.sizes.turn_words)
        self.messages.append({"role": "user", "content": question})
        return {
            "model": model, "messages": list(self.messages), "user": f"user-{self.index}",
            "max_tokens": self.sizes.answer_tokens, "temperature": 0,
        }  # fmt: skip

    def answered(self, answer: str) -> None:
        """The model's answer joins the conversation, as a client sends it back next turn."""
        self.messages.append({"role": "assistant", "content": answer})


def run_gsp(base_url: str, keys: dict[str, str], model: str, sizes: Workloads) -> Tally:
    tally = Tally()
    with httpx.Client(base_url=base_url, timeout=120) as client:

        def one(call: tuple[str, list[dict[str, str]]]) -> None:
            tenant, messages = call
            body = gsp_body(model, messages)
            try:
                tally.add(chat(client, keys[tenant], body)["usage"])
            except Exception as error:  # counted and reported, the run goes on
                tally.fail(str(error))

        with ThreadPoolExecutor(sizes.concurrency) as pool:
            list(pool.map(one, sizes.gsp_calls()))
    return tally


def run_chats(base_url: str, key: str, model: str, sizes: Workloads) -> Tally:
    """Conversations side by side, each one's turns in order, each by its own end user."""
    tally = Tally()
    with httpx.Client(base_url=base_url, timeout=120) as client:

        def conversation(index: int) -> None:
            talk = Conversation(index, sizes)
            for turn in range(sizes.turns):
                try:
                    result = chat(client, key, talk.next_turn(model))
                except Exception as error:
                    tally.fail(f"conversation {index} turn {turn}: {error}")
                    return
                tally.add(result["usage"])
                talk.answered(result["choices"][0]["message"]["content"] or "")

        with ThreadPoolExecutor(sizes.concurrency) as pool:
            list(pool.map(conversation, range(sizes.conversations)))
    return tally


@dataclass
class Cluster:
    """Two workers and a gateway routing to them, with the bench's tenants and their keys."""

    server: RunningServer
    workers: list[LocalWorker]
    keys: dict[str, str]  # an API key per tenant slug
    tenant_ids: dict[str, str]  # the tenants' ids (the workers' cache owners) per slug
    run_dir: Path
    worker_environment: dict[str, str]  # what each worker was started with, besides its own


def worker_environment(kv_cache_bytes: int) -> dict[str, str]:
    """A bench worker's settings: a pool of `kv_cache_bytes`, on one of this machine's cores."""
    return {
        "PREFIXGATE_KV_CACHE_BYTES": str(kv_cache_bytes),
        "PREFIXGATE_MAX_NUM_SEQS": "16",
        "OMP_NUM_THREADS": "1",  # two workers share this machine's cores
        "PREFIXGATE_DTYPE": "float32",  # the pool's size in blocks is then what was asked
    }


def seed_tenants(
    run_dir: Path, tenants: list[tuple[str, str]]
) -> tuple[str, dict[str, str], dict[str, str]]:
    """A fresh SQLite database in `run_dir` with `tenants` (slug, sharing mode), limits that no
    bench reaches and one API key each: (database URL, keys by slug, tenant ids by slug)."""
    from tenancy import api_keys
    from tenancy import tenants as tenancy
    from tenancy.migrate import upgrade
    from tenancy.store import Store
    from tenancy.tenants import TenantLimits

    database = f"sqlite:///{run_dir / 'bench.db'}"
    upgrade(database)
    store = Store.open(database, run_dir / "seed.spool", "bench-key", "bench-signing")
    keys, ids = {}, {}
    with store.transaction() as session:
        limits = TenantLimits(requests_per_minute=100_000, tokens_per_minute=10**9,
                              max_concurrent=10_000, cache_quota_blocks=100_000)  # fmt: skip
        for slug, sharing in tenants:
            tenant = tenancy.create_tenant(session, slug, sharing_mode=sharing, limits=limits)
            keys[slug] = api_keys.create_key(session, tenant, "bench", "bench-key").secret
            ids[slug] = str(tenant.id)
    store.close()
    return database, keys, ids


@contextmanager
def routed_gateway(
    work: Path,
    model_dir: Path,
    kv_cache_bytes: int,
    mode: str,
    tenants: list[tuple[str, str]],
    *,
    name: str | None = None,
    environment: dict[str, str] | None = None,
    settings: dict[str, Any] | None = None,
    side_by_side: bool = False,
) -> Iterator[Cluster]:
    """Two fresh workers and a gateway routing to them in `mode`, in `work`/`name` (default:
    the mode); tenants (slug, sharing mode) with one key each. `environment` adds to the
    workers' settings, `settings` to the gateway's; `side_by_side` starts both workers at once
    (sooner, but each one's start-up timing shares the machine with the other's)."""
    from bench.local_server import serve
    from bench.local_workers import session_certificates, worker_process

    run_dir = work / (name or mode)
    run_dir.mkdir()
    database, keys, ids = seed_tenants(run_dir, tenants)
    env = {**worker_environment(kv_cache_bytes), **(environment or {})}
    with ExitStack() as stack:
        starting = [worker_process(model_dir, WORKER_SECRET, run_dir, env) for _ in range(2)]
        if side_by_side:
            ws = enter_together(stack, starting)
        else:  # one after another: each loads the model alone
            ws = [stack.enter_context(worker) for worker in starting]
        gateway = {
            "database_url": database, "state_dir": run_dir, "key_hash_secret": "bench-key",
            "audit_signing_key": "bench-signing", "model_dir": model_dir,
            "workers": [worker.url for worker in ws], "worker_secret": WORKER_SECRET,
            "routing": mode, "worker_poll_s": 0.5, **session_certificates().gateway_settings(),
            **(settings or {}),
        }  # fmt: skip
        server = stack.enter_context(serve(gateway))
        yield Cluster(server, ws, keys, ids, run_dir, env)


def enter_together(stack: ExitStack, managers: Sequence[AbstractContextManager[T]]) -> list[T]:
    """Enter context managers side by side (processes that each take seconds to be ready);
    each one entered is exited with `stack`, also when another failed to start."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
        wait(futures)
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager)
    return [future.result() for future in futures]


def spread(server: Any) -> dict[str, int]:
    """Prompt tokens each worker was sent, from its own counters (polled now)."""
    server.gateway.engine.workers.poll_once()
    return {url: stats.prompt_tokens for url, stats in server.gateway.engine.worker_stats().items()}


def compare(
    model_dir: Path, model: str, kv_cache_bytes: int, sizes: Workloads,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:  # fmt: skip
    """Both workloads under both routing modes: {mode: {workload: report}}."""
    tenants = [(slug, "tenant") for slug in sizes.gsp_tenants()] + [("chat", "user")]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in MODES:
            progress(f"{mode}: starting two workers and a gateway")
            with routed_gateway(Path(scratch), model_dir, kv_cache_bytes, mode, tenants) as run:
                started = time.perf_counter()
                gsp = run_gsp(run.server.url, run.keys, model, sizes)
                gsp_s = time.perf_counter() - started
                gsp_spread = spread(run.server)
                started = time.perf_counter()
                chats = run_chats(run.server.url, run.keys["chat"], model, sizes)
                chat_s = time.perf_counter() - started
                results[mode] = {
                    "gsp": {**gsp.report(), "seconds": round(gsp_s, 2)},
                    "chat": {**chats.report(), "seconds": round(chat_s, 2)},
                    "prompt_tokens_per_worker_after_gsp": sorted(gsp_spread.values()),
                }
            progress(f"{mode}: {results[mode]['gsp']['cached_share']:.2f} gsp, "
                     f"{results[mode]['chat']['cached_share']:.2f} chat")  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: tiny random)")
    parser.add_argument(
        "--kv-cache-mib", type=float, default=None,
        help="KV pool per worker in MiB (default: 60%% of what the gsp prompts take)",
    )  # fmt: skip
    add_workload_options(parser)
    parser.add_argument("--plot", help="write a PNG bar chart here")
    args = parser.parse_args()
    sizes = workloads_of(args)
    say = (lambda _: None) if args.json else print
    with tempfile.TemporaryDirectory() as scratch:
        model_dir, model = args.model, args.model.name if args.model else BENCH_MODEL
        if model_dir is None:
            from bench.local_server import tiny_chat_model
            from engine.model.loader import embedded_model_dir

            model_dir = tiny_chat_model(Path(scratch) / BENCH_MODEL, embedded_model_dir())
        kv_bytes = kv_cache_bytes(model_dir, sizes, args.kv_cache_mib)
        results = compare(model_dir, model, kv_bytes, sizes, say)
    result = {
        "bench": "routing",
        "machine": machine(),
        "model": model,
        "workers": 2,
        "kv_cache_bytes_per_worker": kv_bytes,
        "workloads": sizes.__dict__,
        "results": results,
        "cached_share_ratio": {workload: ratio(results, workload) for workload in ("gsp", "chat")},
    }
    emit(result, args.json, args.out)
    if not args.json:
        for workload in ("gsp", "chat"):
            shares = [results[mode][workload]["cached_share"] for mode in MODES]
            print(f"{workload}: round robin {shares[0]:.3f}, cache-aware {shares[1]:.3f}")
    if args.plot:
        plot(args.plot, results)


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The workloads' sizes and the output options, as bench.routing and bench.tier take them."""
    parser.add_argument("--groups", type=int, default=Workloads.groups)
    parser.add_argument("--per-group", type=int, default=Workloads.per_group)
    parser.add_argument("--conversations", type=int, default=Workloads.conversations)
    parser.add_argument("--turns", type=int, default=Workloads.turns)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON here")


def workloads_of(args: argparse.Namespace) -> Workloads:
    """The workloads `add_workload_options`' arguments ask for."""
    return Workloads(
        groups=args.groups, per_group=args.per_group,
        conversations=args.conversations, turns=args.turns,
    )  # fmt: skip


def ratio(results: dict[str, Any], workload: str) -> float | None:
    """Cache-aware's cached share over round robin's (None when round robin cached nothing)."""
    baseline = float(results["round_robin"][workload]["cached_share"])
    if not baseline:
        return None
    return round(float(results["cache_aware"][workload]["cached_share"]) / baseline, 3)


def kv_cache_bytes(model_dir: Path, sizes: Workloads, mib: float | None) -> int:
    """The KV pool per worker: `mib`, else `HOLDS` of what every gsp group's prompt takes,
    plus room for the requests in flight (counted with the model's tokenizer, in fp32)."""
    from transformers import AutoTokenizer

    from bench.common import fp32_kv_bytes_per_token
    from policies.templates import render_with_spans

    if mib is not None:
        return int(mib * (1 << 20))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    longest = max(
        len(render_with_spans(tokenizer, messages)[0]) for _, messages in sizes.gsp_calls()
    )
    prompts = sizes.groups * longest
    # Requests in flight share their group's cached prompt: they add their own last blocks.
    in_flight = sizes.concurrency * (sizes.answer_tokens + 32)
    return int((HOLDS * prompts + in_flight) * fp32_kv_bytes_per_token(model_dir))


def plot(path: str, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for offset, mode in enumerate(MODES):
        shares = [results[mode][workload]["cached_share"] for workload in ("gsp", "chat")]
        positions = [index + (offset - 0.5) * width for index in range(2)]
        bars = axes.bar(positions, shares, width, label=mode.replace("_", " "))
        axes.bar_label(bars, fmt="%.2f")
    axes.set_xticks([0, 1], ["groups sharing a system prompt", "multi-turn chat"])
    axes.set_ylabel("prompt tokens served from cache")
    axes.set_ylim(0, 1)
    axes.set_title("Two engine workers: cache-aware routing vs round robin")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
