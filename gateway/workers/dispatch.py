"""Sending one request to a worker that takes it: the pick, the stream, and the failover.

A request goes to the best worker of its model that `routing.rank` finds. If that worker
cannot take it (it is unreachable, draining, overloaded or restarting) or its stream ends
before the first delta, the request goes to the next one: nothing had been streamed, so
nothing is lost or repeated. A worker that fails after the first delta fails that request
cleanly. Each request is signed once (signing.py) for the model it is for, and sent with the
worker secret over the gateway's TLS link (link.py). A worker whose polls get no answer (a
hung machine) ends the streams still waiting on it within a second, so no request hangs on
it; one that only drains or leaves DNS finishes its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import httpx

from engine import errors
from engine.request import GenerationDelta, GenerationRequest
from gateway.workers import routing, signing, wire
from gateway.workers.membership import WorkerSet
from gateway.workers.routing import RoutingConfig
from gateway.workers.worker import PENDING_KEYS_S, Worker

# How often a stream waiting on a worker checks that the worker still answers its polls.
_LIVENESS_CHECK_S = 1.0
T = TypeVar("T")


class Dispatcher:
    """Streams requests from the workers of a `WorkerSet`, each from the best one that takes it."""

    def __init__(self, workers: WorkerSet, config: RoutingConfig) -> None:
        self.workers = workers
        self.config = config
        self._turns = itertools.count()
        self._client: httpx.AsyncClient | None = None

    async def close(self) -> None:
        """Close the connections to the workers (on the event loop that opened them)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def generate(
        self, request: GenerationRequest, fingerprint: str
    ) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas from the best worker of its model that takes it."""
        body = await asyncio.to_thread(wire.request_json, request)
        link = self.workers.link
        signature = link.signer.sign(signing.generation_view(body, fingerprint))
        headers = {**link.headers, signing.SIGNATURE_HEADER: signature}
        tried: set[str] = set()
        while True:
            worker = self._pick(request, tried, fingerprint)
            tried.add(worker.url)
            stream = self._attempt(worker, body, headers, request.tenant_id, request.n)
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
        chains = self._request_keys(request, fingerprint) if cache_aware else {}
        now = time.monotonic()
        with self.workers.lock:
            up = [
                w
                for w in self.workers.workers.values()
                if w.up and w.url not in tried and w.fingerprint == fingerprint
            ]
            if not up:
                raise errors.EngineOverloaded("no engine worker can take the request now")
            if cache_aware:
                ranked = self._rank(request, up, chains, now)
            else:
                plain = [routing.Candidate(w.url, (), w.load, w.free_blocks) for w in up]
                ranked = routing.rotate(plain, next(self._turns))
            worker = self.workers.workers[ranked[0].name]
            worker.send(request.tenant_id, request.n)  # sequences, as the worker counts them
            keys = chains.get(_chain_of(worker) or ("", 0), [])
            worker.pending.update(dict.fromkeys(keys, now + PENDING_KEYS_S))
        return worker

    def _request_keys(
        self, request: GenerationRequest, fingerprint: str
    ) -> dict[tuple[str, int], list[str]]:
        """The request's block keys under each chain the model's workers compute them on
        (hashed outside the lock: workers of one model share one chain)."""
        ours = self.workers.snapshot(
            lambda w: _chain_of(w) if w.fingerprint == fingerprint else None
        )
        chains: dict[tuple[str, int], list[str]] = {}
        for chain in set(ours):
            if chain is not None:
                root, block_size = chain
                chains[chain] = routing.request_keys(
                    request, bytes.fromhex(root), block_size, self.workers.link.digest
                )
        return chains

    def _rank(
        self,
        request: GenerationRequest,
        up: list[Worker],
        chains: dict[tuple[str, int], list[str]],
        now: float,
    ) -> list[routing.Choice]:
        """The workers in routing, best first for this request (under the set's lock)."""
        candidates = [
            routing.Candidate(
                name=w.url,
                keys=w.held(now),
                load=w.load_for(request.tenant_id),
                free_blocks=w.free_blocks,
                request_keys=chains.get(_chain_of(w) or ("", 0), []),
            )
            for w in up
        ]
        first = candidates[0].request_keys
        return routing.rank(
            candidates,
            prompt_tokens=len(request.prompt_token_ids),
            block_size=int(up[0].state["block_size"]),
            load_tokens=self.config.load_tokens,
            max_imbalance=self.config.max_imbalance,
            sticky=first[0] if first else request.tenant_id,
        )

    async def _attempt(
        self,
        worker: Worker,
        body: dict[str, Any],
        headers: dict[str, str],
        tenant_id: str,
        sequences: int,
    ) -> AsyncIterator[GenerationDelta]:
        """One worker's stream. Raises `_TryElsewhere` where nothing was streamed and another
        worker may serve the request; an engine error where no worker could."""
        client = self._http()
        streamed = False
        try:
            request = client.build_request(
                "POST",
                f"{worker.url}/internal/v1/generate",
                json=body,
                headers=headers,
            )
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
                worker.release(tenant_id, sequences)

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
        if status == 403:  # another signing key or a clock off there: the worker, not the request
            self.workers.mark_down(worker, f"it refused this gateway's request signature: {error}")
            return _TryElsewhere()
        return error

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(None, connect=self.workers.timeout_s)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = self.workers.link.async_client(timeout=timeout, limits=limits)
        return self._client


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


class _TryElsewhere(Exception):
    """This worker did not take the request and streamed nothing of it."""


class _WorkerLost(Exception):
    """The worker left routing while a stream waited on it."""
