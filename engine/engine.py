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

from engine.attention import make_backend
from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool
from engine.budget import Owner, TenantBudget
from engine.cache_request import request_block_scopes
from engine.cache_stats import CacheStats
from engine.config import EngineConfig
from engine.errors import (
    ContextTooLong,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
)
from engine.kv_cache_manager import KVCacheManager
from engine.kv_spec import KVSpec, dtype_name
from engine.metrics import EngineMetrics
from engine.model_loader import LoadedModel
from engine.model_runner import Chunk, ModelRunner
from engine.request import GenerationDelta, GenerationRequest, Timings
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, Sink, Status, cache_request

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
            except Exception:  # a bug must not strand every client: fail them and go on
                logger.exception("engine step failed; failing all in-flight requests")
                for sequence in list(self._sequences.values()):
                    self._fail(sequence, EngineError("internal engine error"))
                self.cache.end_step()

    # -- submitting ---------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; deltas and at most one error go to `sink` from the engine thread.

        Raises `InvalidRequest`, `ContextTooLong`, `EngineOverloaded` or `EngineStopped` at
        once for requests that can never be served.
        """
        self._validate(request)
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
        self._post(lambda: self._finish_cancelled(request_id))

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
                    self._fail(sequence, EngineError("the tenant's cache was purged"))
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
            self._fail(sequence, error)
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
        chunks, sampled = [], []
        for scheduled in output.chunks:
            sequence, count = scheduled.sequence, scheduled.num_tokens
            start = sequence.num_computed
            end = start + count
            needs_logits = end == sequence.num_tokens
            chunks.append(
                Chunk(
                    request_id=sequence.request_id,
                    token_ids=sequence.token_ids[start:end],
                    start=start,
                    block_ids=self.cache.block_ids(sequence.request_id),
                    prompt_positions=max(0, min(end, sequence.prompt_len) - start),
                    needs_logits=needs_logits,
                )
            )
            if needs_logits:
                sampled.append(sequence)
        logits = self.runner.run(chunks)
        for scheduled in output.chunks:
            sequence = scheduled.sequence
            sequence.num_computed += scheduled.num_tokens
            self.cache.commit(sequence.request_id, sequence.num_computed)
        if sampled:
            params = [sequence.request.sampling for sequence in sampled]
            generators = [sequence.generator for sequence in sampled]
            for sequence, token in zip(sampled, sample(logits, params, generators), strict=True):
                self._append(sequence, token)

    def _append(self, sequence: Sequence, token: int) -> None:
        params = sequence.request.sampling
        sequence.token_ids.append(token)
        self.cache.append_tokens(sequence.request_id, [token])
        if sequence.first_token_at is None:
            sequence.first_token_at = time.monotonic()
            sequence.first_token_wall = time.time()
            self.metrics.record_ttft(sequence.first_token_at - sequence.arrival)
        finish = None
        text = ""
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.loaded.eos_token_ids
        ):
            finish = "stop"
        elif sequence.detokenizer is not None:
            text = sequence.detokenizer.add(token)
            if sequence.detokenizer.stopped:
                finish = "stop"
        if finish is None and (
            len(sequence.output_ids) >= params.max_tokens
            or sequence.num_tokens >= self.max_model_len
        ):
            finish = "length"
        if finish is None:
            sequence.sink(GenerationDelta(text, [token]))
            return
        if sequence.detokenizer is not None and not sequence.detokenizer.stopped:
            text += sequence.detokenizer.flush()
        self._finish(sequence, GenerationDelta(text, [token], finish))

    def _finish(self, sequence: Sequence, last: GenerationDelta) -> None:
        self.scheduler.remove(sequence)
        usage = sequence.usage(self.runner.forget(sequence.request_id))
        self.metrics.record_finish(usage)
        self._forget(sequence)
        now = time.time()
        timings = Timings(
            sequence.arrived_wall,
            sequence.admitted_wall or now,
            sequence.first_token_wall or now,
            now,
        )
        sequence.sink(
            GenerationDelta(last.text, last.token_ids, last.finish_reason, usage, timings)
        )

    def _fail(self, sequence: Sequence, error: EngineError) -> None:
        self.scheduler.remove(sequence)
        self.runner.forget(sequence.request_id)
        self._forget(sequence)
        sequence.sink(error)

    def _finish_cancelled(self, request_id: str) -> None:
        sequence = self._sequences.get(request_id)
        if sequence is not None and sequence.status is not Status.FINISHED:
            self.scheduler.remove(sequence)
            self.runner.forget(request_id)
            self._forget(sequence)
            self.metrics.cancelled += 1

    def _accept(self, sequence: Sequence) -> None:
        self._sequences[sequence.request_id] = sequence
        self.scheduler.add(sequence)

    def _forget(self, sequence: Sequence) -> None:
        self._sequences.pop(sequence.request_id, None)
        with self._wake:
            self._active.discard(sequence.request_id)

    # -- plumbing -----------------------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = self.loaded.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="prompt")
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ContextTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {len(prompt)} prompt + {request.sampling.max_tokens} "
                f"completion tokens"
            )
        if -(-total // self.config.block_size) > self.pool.num_blocks:
            raise ContextTooLong(f"{total} tokens need more KV blocks than the pool holds")
        if request.sampling.stop and self.loaded.tokenizer is None:
            raise InvalidRequest("stop strings need a model with a tokenizer", param="stop")
        try:
            request_block_scopes(cache_request(request, list(prompt)), self.config.block_size)
        except ValueError as error:
            raise InvalidRequest(f"bad cache scopes: {error}") from error

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
