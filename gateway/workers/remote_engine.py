"""The engine a routing gateway serves from: its workers, behind the in-process engine's face.

The gateway calls it as it calls `engine.engine.Engine` (generate, budgets, purges, cache
statistics, queue depth, describe), so nothing above it knows whether the engine is in this
process or on other machines.

A request goes to the best worker `routing.rank` finds. If that worker cannot take it (it is
unreachable, draining, overloaded or restarting) or its stream ends before the first delta,
the request goes to the next one: nothing had been streamed, so nothing is lost or repeated. A
worker that fails after the first delta fails that request cleanly. A worker whose polls get no
answer (a hung machine) ends the streams still waiting on it within a second, so no request
hangs on it; one that only drains or leaves DNS finishes its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
import httpx

from engine import errors
from engine.budget import Owner, TenantBudget
from engine.cache_stats import CacheStats, OwnerStats
from engine.engine import Engine
from engine.grammar import Grammars
from engine.kv_cache_manager import OwnerCounters
from engine.kv_spec import KVSpec
from engine.model_loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest
from gateway.workers import routing, wire
from gateway.workers.membership import PENDING_KEYS_S, Worker, WorkerSet

# How often a stream waiting on a worker checks that the worker still answers its polls.
_LIVENESS_CHECK_S = 1.0
T = TypeVar("T")
_KV_DTYPES = frozenset({"bfloat16", "float32", "float16"})


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    mode: str  # "cache_aware" or "round_robin"
    load_tokens: int
    max_imbalance: int


class NoWorker(Exception):
    """No worker answered a starting gateway in time."""


class RemotePool:
    """What the gateway reads of "the pool": the KV layout, and the blocks a quota may use.

    A quota holds on every worker, so the blocks it can use are the smallest worker's pool.
    """

    def __init__(self, loaded: LoadedModel, workers: WorkerSet) -> None:
        self._loaded = loaded
        self._workers = workers

    def _states(self) -> list[dict[str, Any]]:
        return [s for s in self._workers.snapshot(lambda w: w.state if w.up else None) if s]

    @property
    def num_blocks(self) -> int:
        sizes = [int(state["stats"]["num_blocks"]) for state in self._states()]
        return min(sizes) if sizes else 0

    @property
    def spec(self) -> KVSpec:
        import torch

        states = self._states()
        kv_dtype = states[0]["describe"]["kv_dtype"] if states else "float32"
        block_size = int(states[0]["block_size"]) if states else 16
        dtype = getattr(torch, kv_dtype if kv_dtype in _KV_DTYPES else "float32")
        loaded = self._loaded
        return KVSpec(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, dtype, block_size)


class _Counters:
    """`engine.metrics` as the gateway's Prometheus collector reads it."""

    def __init__(self, workers: WorkerSet) -> None:
        self._workers = workers

    @property
    def preemptions(self) -> int:
        return sum(self._workers.snapshot(lambda w: int(w.state.get("preemptions", 0))))


class RemoteEngine:
    """Generation and administration over a set of engine workers."""

    def __init__(self, loaded: LoadedModel, workers: WorkerSet, config: RoutingConfig) -> None:
        self.loaded = loaded
        self.workers = workers
        self.config = config
        self.pool = RemotePool(loaded, workers)
        self.metrics = _Counters(workers)
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        self._turns = itertools.count()
        self._client: httpx.AsyncClient | None = None
        self.max_model_len = loaded.max_model_len

    def start(self, wait_s: float) -> RemoteEngine:
        """Start polling, and wait up to `wait_s` for a worker (`NoWorker` if none answers)."""
        self.workers.start()
        if not self.workers.wait_for_any(wait_s):
            why = self.workers.why_none()
            self.workers.stop()
            raise NoWorker(f"no engine worker answered within {wait_s:g} s ({why})")
        lengths = self.workers.snapshot(lambda w: w.state.get("max_model_len") if w.up else None)
        self.max_model_len = min([int(n) for n in lengths if n] or [self.max_model_len])
        return self

    @property
    def running(self) -> bool:
        return bool(self.workers.routable())

    def stop(self, timeout: float | None = None) -> None:
        """Stop polling (in-flight streams finish on their own)."""
        self.workers.stop()

    async def close_connections(self) -> None:
        """Close the connections to the workers (on the event loop that opened them)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas from the best worker that takes it."""
        body = await asyncio.to_thread(wire.request_json, request)
        tried: set[str] = set()
        while True:
            worker = self._pick(request, tried)
            tried.add(worker.url)
            stream = self._attempt(worker, body, request.n)
            try:
                first = await anext(stream)
            except _TryElsewhere:
                continue
            except StopAsyncIteration:  # pragma: no cover - a worker always ends with usage
                raise errors.EngineError("the worker sent no output") from None
            try:
                yield first
                async for delta in stream:
                    yield delta
            finally:  # shielded: a stream response's task group cancels every later await
                with anyio.CancelScope(shield=True):
                    await stream.aclose()  # type: ignore[attr-defined]
            return

    def _pick(self, request: GenerationRequest, tried: set[str]) -> Worker:
        """The best worker not yet tried; the request's choices count as in flight there from
        now, and its keys as held there (until the worker publishes them or `PENDING_KEYS_S`)."""
        cache_aware = self.config.mode == "cache_aware"
        chains: dict[tuple[str, int], list[str]] = {}
        if cache_aware:  # hashed outside the lock: workers of one model share one chain
            for chain in set(self.workers.snapshot(_chain_of)):
                if chain is not None:
                    root, block_size = chain
                    keys = routing.request_keys(request, bytes.fromhex(root), block_size)
                    chains[chain] = keys
        now = time.monotonic()
        with self.workers.lock:
            up = [w for w in self.workers.workers.values() if w.up and w.url not in tried]
            if not up:
                raise errors.EngineOverloaded("no engine worker can take the request now")
            if not cache_aware:
                plain = [routing.Candidate(w.url, (), w.load, w.free_blocks) for w in up]
                ranked = routing.rotate(plain, next(self._turns))
            else:
                candidates = [
                    routing.Candidate(
                        w.url, w.held(now), w.load, w.free_blocks,
                        chains.get(_chain_of(w) or ("", 0), []),
                    )
                    for w in up
                ]  # fmt: skip
                block_size = int(up[0].state["block_size"])
                first = candidates[0].request_keys
                sticky = first[0] if first else request.tenant_id
                ranked = routing.rank(
                    candidates,
                    len(request.prompt_token_ids),
                    block_size,
                    self.config.load_tokens,
                    self.config.max_imbalance,
                    sticky,
                )
            worker = self.workers.workers[ranked[0].name]
            worker.in_flight += request.n  # sequences, as the worker counts them
            keys = chains.get(_chain_of(worker) or ("", 0), [])
            worker.pending.update(dict.fromkeys(keys, now + PENDING_KEYS_S))
        return worker

    async def _attempt(
        self, worker: Worker, body: dict[str, Any], sequences: int
    ) -> AsyncIterator[GenerationDelta]:
        """One worker's stream. Raises `_TryElsewhere` where nothing was streamed and another
        worker may serve the request; an engine error where no worker could."""
        client = self._http()
        streamed = False
        try:
            request = client.build_request(
                "POST", f"{worker.url}/internal/v1/generate", json=body,
                headers=self.workers.headers,
            )  # fmt: skip
            try:  # a hung worker accepts the connection (the kernel does) and never answers
                sending = client.send(request, stream=True)
                response = await _unless_silent(worker, sending, discard=_close_response)
            except (httpx.HTTPError, _WorkerLost) as error:
                self.workers.mark_down(worker, f"request failed: {error!r}")
                raise _TryElsewhere from None
            try:
                if response.status_code != 200:
                    raise self._refusal(worker, response.status_code, await response.aread())
                lines = response.aiter_lines()
                while True:
                    try:
                        line = await _unless_silent(worker, anext(lines))
                    except StopAsyncIteration:
                        if streamed:
                            return
                        raise _TryElsewhere from None
                    except (httpx.HTTPError, _WorkerLost) as error:
                        self.workers.mark_down(worker, f"stream broke: {error}")
                        if streamed:
                            raise errors.RequestFailed(  # this request alone: 500, retryable
                                "the engine worker serving this request stopped answering"
                            ) from None
                        raise _TryElsewhere from None
                    if not line:
                        continue
                    try:
                        message = json.loads(line)
                        delta = None if "error" in message else wire.read_delta(message["delta"])
                    except (ValueError, KeyError, TypeError):  # another version's worker
                        raise errors.RequestFailed(
                            "the engine worker sent a malformed answer"
                        ) from None
                    if delta is None:
                        raise wire.read_error(message["error"])
                    streamed = True
                    yield delta
            finally:  # closing the connection is what cancels the request on the worker
                with anyio.CancelScope(shield=True):
                    await response.aclose()
        finally:
            with self.workers.lock:
                worker.in_flight -= sequences

    def _refusal(self, worker: Worker, status: int, body: bytes) -> Exception:
        """A worker's refusal before anything streamed: try elsewhere, or the engine error."""
        try:
            error = wire.read_error(json.loads(body)["error"])
        except (ValueError, KeyError, TypeError):
            error = errors.EngineError(f"the worker answered {status}")
        if status == 503:
            return _TryElsewhere()  # draining, overloaded or restarting: another may take it
        if status == 401:
            self.workers.mark_down(worker, "it refused the worker secret")
            return _TryElsewhere()
        return error

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(None, connect=self.workers.timeout_s)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        return self._client

    # -- administration -----------------------------------------------------------------------

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        return self.workers.set_budget(owner, budget)

    def purge_tenant(self, tenant_id: str) -> int:
        return self.workers.purge(tenant_id)

    def drop_public_prefix(self, namespace: str, token_ids: Any) -> int:
        return self.workers.drop_public_prefix(namespace, list(token_ids))

    # -- what the gateway reads ---------------------------------------------------------------

    def worker_stats(self) -> dict[str, CacheStats]:
        """Each worker's cache statistics as of its last poll (those that answer, draining
        ones too: they still hold blocks)."""
        rows = self.workers.snapshot(lambda w: None if w.lost else (w.url, w.stats))
        return {url: stats for url, stats in (row for row in rows if row) if stats is not None}

    def cache_stats(self) -> CacheStats:
        """The workers' caches summed: each tenant's blocks and quota over every worker."""
        return total_stats(list(self.worker_stats().values()))

    def queue_depth(self) -> tuple[int, int]:
        rows = self.workers.snapshot(
            lambda w: (
                (0, 0)
                if w.lost
                else (int(w.state.get("waiting", 0)), int(w.state.get("running", 0)))
            )
        )
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    @property
    def restarts(self) -> int:
        rows = self.workers.snapshot(lambda w: int(w.state.get("describe", {}).get("restarts", 0)))
        return sum(rows)

    def worker_rows(self) -> list[dict[str, Any]]:
        """Each worker that discovery names: address, whether it is in routing, its load."""
        rows = self.workers.snapshot(
            lambda w: (
                None
                if w.unlisted_since is not None
                else {
                    "url": w.url,
                    "up": w.up,
                    "in_flight": w.in_flight,
                    "load": w.reported_load,
                    "cached_keys": len(w.keys),
                    "last_error": w.last_error,
                }
            )
        )
        return [row for row in rows if row is not None]

    def describe(self) -> dict[str, Any]:
        """What serves, for /readyz and the start-up log: counts, not the workers' addresses
        (/metrics names them; /readyz is public). The engine's choices (device, dtypes,
        kernels) are the value every worker in routing reports, or "mixed"; `kv_blocks` is
        the first one's."""
        rows = self.worker_rows()
        described: list[dict[str, Any]] = [
            w.state.get("describe", {}) for w in self.workers.routable()
        ]
        choices = ("device", "dtype", "kv_dtype", "logits_dtype", "attention_backend",
                   "linear_kernel")  # fmt: skip
        return {
            "model": self.loaded.name,
            "routing": self.config.mode,
            "workers": len(rows),
            "workers_up": sum(1 for row in rows if row["up"]),
            **{key: _agreed(d.get(key) for d in described) for key in choices},
            "kv_blocks": described[0].get("kv_blocks") if described else None,
        }


def _agreed(values: Iterable[Any]) -> Any:
    """The one value all workers report (None with no worker), or "mixed"."""
    distinct = set(values)
    if len(distinct) > 1:
        return "mixed"
    return next(iter(distinct), None)


def total_stats(parts: list[CacheStats]) -> CacheStats:
    """Several caches as one: every count summed, each owner's over the caches it is in."""
    owners: dict[Owner, OwnerStats] = {}
    for stats in parts:
        for owner, own in stats.owners.items():
            seen = owners.get(owner)
            owners[owner] = own if seen is None else _add_owner(seen, own)
    zero = CacheStats(0, 0, 0, 0, 0, 0, 0, {})
    total = zero
    for stats in parts:
        total = replace(
            total,
            num_blocks=total.num_blocks + stats.num_blocks,
            free_blocks=total.free_blocks + stats.free_blocks,
            cached_keys=total.cached_keys + stats.cached_keys,
            blocks_zeroed=total.blocks_zeroed + stats.blocks_zeroed,
            zero_operations=total.zero_operations + stats.zero_operations,
            collisions=total.collisions + stats.collisions,
            peak_active_blocks=total.peak_active_blocks + stats.peak_active_blocks,
        )
    return replace(total, owners=owners)


def _add_owner(a: OwnerStats, b: OwnerStats) -> OwnerStats:
    counters = OwnerCounters(
        **{
            name: getattr(a.counters, name) + getattr(b.counters, name)
            for name in a.counters.__dataclass_fields__
        }
    )
    return OwnerStats(
        active_blocks=a.active_blocks + b.active_blocks,
        cached_blocks=a.cached_blocks + b.cached_blocks,
        reserved_blocks=a.reserved_blocks + b.reserved_blocks,
        quota_blocks=a.quota_blocks + b.quota_blocks,
        counters=counters,
    )


async def _unless_silent(
    worker: Worker,
    work: Awaitable[T],
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """`work`'s result, unless the worker goes silent first (`_WorkerLost`): polls found it
    answering nothing, as a hung machine. A worker that only drains or leaves DNS keeps its
    streams. `discard` cleans up a result that arrives after the caller gave up."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_LIVENESS_CHECK_S)
            if done:
                return task.result()
            if worker.silent:
                raise _WorkerLost(f"{worker.url} stopped answering")
    finally:
        # Shielded: the task must finish its own cleanup (httpcore closes the connection
        # there) before the caller goes on; a cancelled caller would otherwise leave it
        # pending, unreferenced, and the connection to the worker open.
        with anyio.CancelScope(shield=True):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            elif discard is not None and sys.exc_info()[0] is not None and _succeeded(task):
                await discard(task.result())


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return not task.cancelled() and task.exception() is None


async def _close_response(response: httpx.Response) -> None:
    await response.aclose()


def _chain_of(worker: Worker) -> tuple[str, int] | None:
    """What a worker's keys chain from: its root key and block size (None before a poll)."""
    if not worker.state:
        return None
    return str(worker.state["root"]), int(worker.state["block_size"])


# What a gateway serves from: the engine in this process, or its workers.
ServingEngine = Engine | RemoteEngine


class _TryElsewhere(Exception):
    """This worker did not take the request and streamed nothing of it."""


class _WorkerLost(Exception):
    """The worker left routing while a stream waited on it."""
