"""The engine: a loop in its own thread that schedules, runs the model and streams deltas.

Callers submit requests from any thread or event loop; everything that touches the KV cache
runs on the engine thread, one step at a time. Cancellation, purges and budget changes are
queued to that thread and take effect at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

import torch

from engine.attention import make_backend
from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool
from engine.budget import Owner, TenantBudget
from engine.cache_stats import CacheStats
from engine.config import EngineConfig
from engine.errors import (
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    RequestFailed,
)
from engine.fault_isolation import run_isolated
from engine.kv_cache_manager import KVCacheManager
from engine.kv_spec import KVSpec, dtype_name
from engine.metrics import EngineMetrics
from engine.model_loader import LoadedModel
from engine.model_runner import Chunk, ModelRunner
from engine.request import GenerationDelta, GenerationRequest, Timings
from engine.sampler import sample
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, Sink
from engine.validation import ModelLimits, validate

T = TypeVar("T")
logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5


class Engine:
    """Serves generation requests for one model on a paged, prefix-cached KV pool."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        model = loaded.model
        self.device = next(model.parameters()).device
        kv_dtype = config.kv_dtype or model.dtype
        spec = KVSpec(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, kv_dtype, config.block_size
        )
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // spec.bytes_per_block)
        self.pool = BlockPool(spec, num_blocks, self.device)
        hasher = BlockHasher(config.block_size)
        self.cache = KVCacheManager(
            self.pool,
            hasher,
            hasher.root(loaded.fingerprint, config.adapter_id, dtype_name(kv_dtype)),
            public_budget=config.public_budget,
            default_budget=config.default_budget,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.cache,
            SchedulerConfig(
                config.max_num_batched_tokens, config.max_num_seqs, config.queue_timeout_s
            ),
        )
        self.runner = ModelRunner(model, self.pool.kv, make_backend(config.attention_backend))
        self.max_model_len = config.max_model_len or loaded.max_model_len
        self.limits = ModelLimits(
            loaded.vocab_size, self.max_model_len, loaded.tokenizer is not None
        )
        self.metrics = EngineMetrics()
        self._inbox: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._active: set[str] = set()
        self._sequences: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._cache_stats = self.cache.stats()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(
                target=self._loop, name="prefixgate-engine", daemon=True
            )
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is running and waiting, then stop the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self.scheduler.has_work() and not self._stopping:
                    self._wake.wait(_IDLE_WAIT_S)
                if self._stopping and not self._inbox and not self.scheduler.has_work():
                    return
            try:
                self.step()
            except Exception:  # the last resort, for a bug outside any one request's part
                logger.exception("engine step failed; failing all in-flight requests")
                for sequence in list(self._sequences.values()):
                    self._settle(sequence, EngineError("internal engine error"))
                self.cache.end_step()

    # -- submitting ---------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; deltas and at most one error go to `sink` from the engine thread.

        Raises `InvalidRequest` (`ContextTooLong`, `ExceedsCacheQuota`), `EngineOverloaded`
        or `EngineStopped` at once for requests that can never be served.
        """
        validate(request, self.limits, self.cache)
        sequence = Sequence.create(request, sink, self.loaded.tokenizer, self.device)
        with self._wake:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if request.request_id in self._active:
                raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
            if len(self._active) >= self.config.max_waiting + self.config.max_num_seqs:
                raise EngineOverloaded("too many requests in flight; retry shortly")
            self._active.add(request.request_id)
            self._inbox.append(lambda: self._accept(sequence))
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step boundary."""
        self._post(lambda: self._cancel(request_id))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream a request's deltas; the last one carries `finish_reason` and `usage`.

        Closing the iterator early (a client went away) cancels the request. Starts the
        engine thread if it is not running.
        """
        self.start()
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[GenerationDelta | Exception] = asyncio.Queue()

        def sink(item: GenerationDelta | Exception) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's event loop may be gone
                loop.call_soon_threadsafe(deltas.put_nowait, item)

        self.submit(request, sink)
        finished = False
        try:
            while not finished:
                delta = _delta_or_raise(await deltas.get())
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:  # abandoned (or failed: then cancelling is a no-op)
                self.cancel(request.request_id)

    def generate_sync(self, request: GenerationRequest) -> Iterator[GenerationDelta]:
        """`generate` for plain threads: blocks on each delta."""
        self.start()
        deltas: queue.Queue[GenerationDelta | Exception] = queue.Queue()
        self.submit(request, deltas.put)
        finished = False
        try:
            while not finished:
                delta = _delta_or_raise(deltas.get())
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.cancel(request.request_id)

    # -- administration -----------------------------------------------------------------------

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        """Change a tenant's (or the public) cache budget now; returns blocks evicted."""
        return self._call(lambda: self.cache.set_budget(owner, budget))

    def purge_tenant(self, tenant_id: str) -> int:
        """Cancel the tenant's requests, then drop and zero all its cached blocks."""

        def purge() -> int:
            for sequence in list(self._sequences.values()):
                if sequence.request.tenant_id == tenant_id:
                    self._settle(sequence, EngineError("the tenant's cache was purged"))
            return self.cache.purge(tenant_id)

        return self._call(purge)

    def cache_stats(self) -> CacheStats:
        """The cache as of the last step (safe from any thread)."""
        return self._cache_stats

    def queue_depth(self) -> tuple[int, int]:
        """(waiting, running) sequences as of the last step."""
        return self.metrics.waiting, self.metrics.running

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one scheduling step on the calling thread; returns whether there was work."""
        self._drain_inbox()
        if not self.scheduler.has_work():
            self._cache_stats = self.cache.stats()
            return False
        started = time.perf_counter()
        output = self.scheduler.schedule()
        for sequence, error in output.failed:
            self._settle(sequence, error)
        if output.chunks:
            self._execute(output)
        self.cache.end_step()
        self._cache_stats = self.cache.stats()
        self.metrics.record_step(
            time.perf_counter() - started,
            sum(chunk.num_tokens for chunk in output.chunks),
            output.preempted,
            len(self.scheduler.waiting),
            len(self.scheduler.running),
        )
        return True

    def _execute(self, output: SchedulerOutput) -> None:
        """Run the step's chunks; a request whose part fails is settled alone, the rest go on."""
        scheduled = output.chunks
        chunks = [self._chunk(item) for item in scheduled]
        step = run_isolated(self.runner.run, chunks)
        failures: dict[Sequence, EngineError] = {}
        for index, error in step.failed.items():
            logger.warning("request failed its step alone", exc_info=error)
            failures[scheduled[index].sequence] = RequestFailed(
                "the model failed on this request's input"
            )
        sampled = [
            item.sequence
            for index, (item, chunk) in enumerate(zip(scheduled, chunks, strict=True))
            if chunk.needs_logits and index not in step.failed
        ]
        tokens = self._sample(step.logits(), sampled)
        for sequence, token in zip(sampled, tokens, strict=True):
            if isinstance(token, EngineError):
                failures[sequence] = token
        for sequence, error in failures.items():
            self._settle(sequence, error)  # before commit: its blocks are never cached
        for item in scheduled:
            if item.sequence not in failures:
                item.sequence.num_computed += item.num_tokens
                self.cache.commit(item.sequence.request_id, item.sequence.num_computed)
        for sequence, token in zip(sampled, tokens, strict=True):
            if isinstance(token, int):
                try:
                    self._append(sequence, token)
                except Exception:  # handling one request's output fails that request only
                    logger.exception("handling a request's output failed")
                    self._settle(sequence, RequestFailed("handling this request's output failed"))

    def _chunk(self, scheduled: ScheduledChunk) -> Chunk:
        sequence, start = scheduled.sequence, scheduled.sequence.num_computed
        end = start + scheduled.num_tokens
        return Chunk(
            request_id=sequence.request_id,
            token_ids=sequence.token_ids[start:end],
            start=start,
            block_ids=self.cache.block_ids(sequence.request_id),
            prompt_positions=max(0, min(end, sequence.prompt_len) - start),
            needs_logits=end == sequence.num_tokens,
        )

    def _sample(
        self, logits: torch.Tensor | None, sampled: list[Sequence]
    ) -> list[int | RequestFailed]:
        if logits is None or not sampled:
            return []
        params = [sequence.request.sampling for sequence in sampled]
        return sample(logits, params, [sequence.generator for sequence in sampled])

    def _append(self, sequence: Sequence, token: int) -> None:
        first = sequence.first_token_at is None
        delta = sequence.append(token, self.loaded.eos_token_ids, self.max_model_len)
        self.cache.append_tokens(sequence.request_id, [token])
        if first and sequence.first_token_at is not None:
            self.metrics.record_ttft(sequence.first_token_at - sequence.arrival)
        if delta.finish_reason is None:
            sequence.sink(delta)
        else:
            self._settle(sequence, delta)

    def _cancel(self, request_id: str) -> None:
        sequence = self._sequences.get(request_id)
        if sequence is not None:
            self._settle(sequence, None)

    def _settle(self, sequence: Sequence, outcome: GenerationDelta | EngineError | None) -> None:
        """End a request, once: free its blocks, forget it, and send its last delta or error.

        `outcome` is the last delta (finished), an error (failed) or None (cancelled: nobody is
        listening).
        """
        if self._sequences.pop(sequence.request_id, None) is None:
            return  # already settled
        # A failed request's KV may be what failed it: none of it stays cached.
        self.scheduler.remove(sequence, keep_computed=not isinstance(outcome, EngineError))
        computed_prompt_positions = self.runner.forget(sequence.request_id)
        with self._wake:
            self._active.discard(sequence.request_id)
        if outcome is None:
            self.metrics.cancelled += 1
            return
        if isinstance(outcome, GenerationDelta):
            usage = sequence.usage(computed_prompt_positions)
            self.metrics.record_finish(usage)
            now = time.time()
            timings = Timings(
                sequence.arrived_wall,
                sequence.admitted_wall or now,
                sequence.first_token_wall or now,
                now,
            )
            last = outcome
            outcome = GenerationDelta(last.text, last.token_ids, last.finish_reason, usage, timings)
        try:
            sequence.sink(outcome)
        except Exception:  # the request is over either way; the engine must go on
            logger.exception("a request's sink raised on its last item")

    def _accept(self, sequence: Sequence) -> None:
        self._sequences[sequence.request_id] = sequence
        self.scheduler.add(sequence)

    # -- plumbing -----------------------------------------------------------------------------

    def _post(self, action: Callable[[], None]) -> None:
        with self._wake:
            self._inbox.append(action)
            self._wake.notify()

    def _call(self, action: Callable[[], T]) -> T:
        """Run `action` on the engine thread (or right here if no thread runs) and wait."""
        if self._thread is None or threading.current_thread() is self._thread:
            self._drain_inbox()
            return action()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(action())
            except BaseException as error:  # handed to the waiting caller
                future.set_exception(error)

        self._post(run)
        return future.result()

    def _drain_inbox(self) -> None:
        with self._wake:
            actions, self._inbox = self._inbox, []
        for action in actions:
            action()


def _delta_or_raise(item: GenerationDelta | Exception) -> GenerationDelta:
    if isinstance(item, Exception):
        raise item
    return item
