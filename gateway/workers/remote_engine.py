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
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
import httpx

from engine import errors
from engine.cache.budget import Owner, TenantBudget
from engine.cache.kv_cache_manager import OwnerCounters
from engine.cache.stats import CacheStats, OwnerStats
from engine.engine import Engine
from engine.model.loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest
from gateway.workers import routing, wire
from gateway.workers.membership import PENDING_KEYS_S, Worker, WorkerSet
from gateway.workers.models import ModelCatalog
from gateway.workers.remote_model import RemoteModel, RemotePool

# How often a stream waiting on a worker checks that the worker still answers its polls.
_LIVENESS_CHECK_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    mode: str  # "cache_aware" or "round_robin"
    load_tokens: int
    max_imbalance: int


class NoWorker(Exception):
    """No worker answered a starting gateway in time."""


class _Counters:
    """`engine.metrics` as the gateway's Prometheus collector reads it."""

    def __init__(self, workers: WorkerSet) -> None:
        self._workers = workers

    @property
    def preemptions(self) -> int:
        return sum(self._workers.snapshot(lambda w: int(w.state.get("preemptions", 0))))


class RemoteEngine:
    """Generation and administration over a set of engine workers, of one model or several."""

    def __init__(self, workers: WorkerSet, config: RoutingConfig) -> None:
        assert workers.models is not None  # a routing gateway learns its models from workers
        self.workers = workers
        self.catalog: ModelCatalog = workers.models
        self.config = config
        self.pool = RemotePool(self)
        self.metrics = _Counters(workers)
        self._models: dict[tuple[str, str], RemoteModel] = {}  # by name and fingerprint
        self._models_lock = threading.Lock()  # read by requests and admin calls, on threads
        self._summed_at: tuple[int, tuple[CacheStats, dict[str, CacheStats]]] | None = None
        self._summed_lock = threading.Lock()
        self._turns = itertools.count()
        self._client: httpx.AsyncClient | None = None

    def start(self, wait_s: float) -> RemoteEngine:
        """Start polling, and wait up to `wait_s` for a worker (`NoWorker` if none answers)."""
        self.workers.start()
        if not self.workers.wait_for_any(wait_s):
            why = self.workers.why_none()
            self.workers.stop()
            raise NoWorker(f"no engine worker answered within {wait_s:g} s ({why})")
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

    # -- models -------------------------------------------------------------------------------

    def models(self) -> dict[str, RemoteModel]:
        """Every model with a worker in routing, by name. A name served under two
        fingerprints (a rolling update) is the one with more workers in routing (the one met
        first when they are as many)."""
        counts: dict[tuple[str, str], int] = {}
        for row in self.workers.snapshot(lambda w: (w.model, w.fingerprint) if w.up else None):
            if row is not None:
                counts[row] = counts.get(row, 0) + 1
        best: dict[str, tuple[int, int, str]] = {}
        for (name, fingerprint), count in counts.items():
            rank = (count, -self.catalog.met(fingerprint), fingerprint)
            best[name] = max(best.get(name, (0, -(1 << 63), "")), rank)
        with self._models_lock:
            for key in [key for key in self._models if self.catalog.get(key[1]) is None]:
                del self._models[key]  # no worker serves it any more
        served: dict[str, RemoteModel] = {}
        for name, (_, _, fingerprint) in sorted(best.items()):
            model = self._model(name, fingerprint)
            if model is not None:
                served[name] = model
        return served

    def _model(self, name: str, fingerprint: str) -> RemoteModel | None:
        with self._models_lock:
            model = self._models.get((name, fingerprint))
            if model is None:
                loaded = self.catalog.get(fingerprint, name)
                if loaded is None:
                    return None
                model = self._models[(name, fingerprint)] = RemoteModel(self, loaded)
            return model

    def routable_states(
        self, fingerprint: str | None = None
    ) -> list[tuple[LoadedModel | None, dict[str, Any]]]:
        """The last state of each worker in routing (of one model, if given), with its model."""
        rows = self.workers.snapshot(
            lambda w: (
                (w.fingerprint, w.state)
                if w.up and w.state and fingerprint in (None, w.fingerprint)
                else None
            )
        )
        return [(self.catalog.get(fp), state) for fp, state in (row for row in rows if row)]

    def known_models(self, fingerprint: str | None = None) -> list[LoadedModel]:
        """Models this gateway has loaded (of one fingerprint, if given)."""
        fingerprints = {fp for fp in self.workers.snapshot(lambda w: w.fingerprint) if fp}
        found = [self.catalog.get(fp) for fp in sorted(fingerprints)]
        return [m for m in found if m and fingerprint in (None, m.fingerprint)]

    # -- generation ---------------------------------------------------------------------------

    async def generate(
        self, request: GenerationRequest, fingerprint: str
    ) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas from the best worker of its model that takes it."""
        body = await asyncio.to_thread(wire.request_json, request)
        tried: set[str] = set()
        while True:
            worker = self._pick(request, tried, fingerprint)
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

    def _pick(self, request: GenerationRequest, tried: set[str], fingerprint: str) -> Worker:
        """The best worker of the model not yet tried; the request's choices count as in
        flight there from now, and its keys as held there (until the worker publishes them or
        `PENDING_KEYS_S`). Workers of other models are never considered."""
        cache_aware = self.config.mode == "cache_aware"
        chains: dict[tuple[str, int], list[str]] = {}
        if cache_aware:  # hashed outside the lock: workers of one model share one chain
            ours = self.workers.snapshot(
                lambda w: _chain_of(w) if w.fingerprint == fingerprint else None
            )
            for chain in set(ours):
                if chain is not None:
                    root, block_size = chain
                    keys = routing.request_keys(request, bytes.fromhex(root), block_size)
                    chains[chain] = keys
        now = time.monotonic()
        with self.workers.lock:
            up = [
                w
                for w in self.workers.workers.values()
                if w.up and w.url not in tried and w.fingerprint == fingerprint
            ]
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

    def drop_public_prefix(
        self, namespace: str, token_ids: Any, fingerprint: str | None = None
    ) -> int:
        return self.workers.drop_public_prefix(namespace, list(token_ids), fingerprint)

    # -- what the gateway reads ---------------------------------------------------------------

    def worker_stats(self) -> dict[str, CacheStats]:
        """Each worker's cache statistics as of its last poll (those that answer, draining
        ones too: they still hold blocks)."""
        return {url: stats for url, _, stats in self._answering()}

    def cache_stats(self) -> CacheStats:
        """The workers' caches summed: each tenant's blocks and quota over every worker."""
        return self._summed()[0]

    def _answering(self) -> list[tuple[str, str, CacheStats]]:
        """(url, model, stats) of each worker that answers, as of the last poll."""
        rows = self.workers.snapshot(
            lambda w: None if w.lost or w.stats is None else (w.url, w.model, w.stats)
        )
        return [row for row in rows if row is not None]

    def _summed(self) -> tuple[CacheStats, dict[str, CacheStats]]:
        """Every worker's cache summed, and each model's: worked out once per change of what
        the workers reported (an admin page asks for them once per tenant it shows)."""
        with self._summed_lock:
            version = self.workers.version
            if self._summed_at is None or self._summed_at[0] != version:
                answering = self._answering()
                parts: dict[str, list[CacheStats]] = {}
                for _, model, stats in answering:
                    if model:
                        parts.setdefault(model, []).append(stats)
                summed = (
                    total_stats([stats for _, _, stats in answering]),
                    {model: total_stats(stats) for model, stats in sorted(parts.items())},
                )
                self._summed_at = (version, summed)
            return self._summed_at[1]

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
        """Each worker that discovery names: address, model, whether it is in routing, load."""
        rows = self.workers.snapshot(
            lambda w: (
                None
                if w.unlisted_since is not None
                else {
                    "url": w.url,
                    "model": w.model or None,
                    "up": w.up,
                    "in_flight": w.in_flight,
                    "load": w.reported_load,
                    "cached_keys": len(w.keys),
                    "last_error": w.last_error,
                }
            )
        )
        return [row for row in rows if row is not None]

    def pool_stats(self) -> dict[str, CacheStats]:
        """Each model's pool: its workers' caches summed (those that answer, draining too)."""
        return self._summed()[1]

    def describe(self) -> dict[str, Any]:
        """What serves, for /readyz and the start-up log: counts, not the workers' addresses
        (/metrics names them; /readyz is public). The engine's choices (device, dtypes,
        kernels) are the value every worker in routing reports, or "mixed"; `kv_blocks` is
        the smallest pool's."""
        rows = self.worker_rows()
        described: list[dict[str, Any]] = [
            w.state.get("describe", {}) for w in self.workers.routable()
        ]
        choices = ("device", "dtype", "kv_dtype", "logits_dtype", "attention_backend",
                   "linear_kernel")  # fmt: skip
        return {
            "models": sorted(self.models()),
            "routing": self.config.mode,
            "workers": len(rows),
            "workers_up": sum(1 for row in rows if row["up"]),
            **{key: _agreed(d.get(key) for d in described) for key in choices},
            "kv_blocks": self.pool.num_blocks or None,
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
