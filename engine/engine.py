"""The engine as callers see it: submit a request, stream its deltas, cancel it, administer
the cache.

Callers submit requests from any thread or event loop; everything that touches the KV cache
runs on the engine thread, one step at a time (`core.py`). Requests, cancellations, purges and
budget changes are queued to that thread (see `inbox.py`) and take effect at the next step
boundary; what callers read back (cache stats, queue depth, cached keys) is what the thread
recorded at its last step or admin action, so reading never waits for a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections import abc
from collections.abc import AsyncIterator, Callable, Iterator

from engine.cache.block_hash import BlockHash
from engine.cache.budget import Owner, TenantBudget
from engine.cache.stats import CacheStats
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import EngineOverloaded, EngineStopped, InvalidRequest
from engine.metrics import TenantService
from engine.model.loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest
from engine.sequence import Sequence, Sink
from engine.structured.grammar import Grammars
from engine.validation import ModelLimits, validate
from engine.warm_up import warm_up

# How long a stopping engine waits for the second tier to store its queued offloads.
TIER_FLUSH_S = 5.0


class Engine(EngineCore):
    """Serves generation requests for one model on a paged, prefix-cached KV pool."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        super().__init__(loaded, config)
        self.limits = ModelLimits(
            loaded.vocab_size, self.max_model_len, loaded.tokenizer is not None
        )
        # Structured outputs: callers compile a request's response format with this.
        self.grammars = Grammars(
            loaded.tokenizer,
            loaded.vocab_size,
            loaded.eos_token_ids,
            self.config.compile_limits,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread (idempotent) and, the first time, warm it up
        (engine/warm_up.py): the first requests run as fast as the later ones."""
        # A lambda: a restart replaces the scheduler.
        self._inbox.start(self._step_or_restart, lambda: self.scheduler.has_work())
        warm = self.config.warm_up and not self.warm_up_s
        if warm and self.pool.num_available == self.pool.num_blocks:
            self.warm_up_s = self._inbox.call(
                lambda: warm_up(
                    self.runner,
                    self.pool,
                    self.config.max_num_batched_tokens,
                    self.max_model_len,
                )
            )
        return self

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive and not restarting its state."""
        return self._inbox.running and not self._restarting

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is running and waiting, then stop the thread and end the grammar
        compile processes."""
        self._inbox.stop(timeout)
        self.grammars.close()
        if self.kv_tier is not None and not self._inbox.running:
            # What was computed is worth keeping for the next start: offloads still queued
            # get a moment to be stored.
            with contextlib.suppress(TimeoutError):  # what is left is recomputed next time
                self.kv_tier.flush(TIER_FLUSH_S)
            self.kv_tier.close()
        if self.threads is not None and not self._inbox.running:
            self.threads.restore()  # torch gives later threads the count it was last set to

    # -- submitting ---------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; deltas and at most one error go to `sink` from the engine thread.

        Raises `InvalidRequest` (`ContextTooLong`, `ExceedsCacheQuota`), `EngineOverloaded`
        or `EngineStopped` at once for requests that can never be served.
        """
        cache = validate(request, self.limits, self.cache)
        sequence = Sequence.create(
            request, sink, cache, self.loaded.tokenizer, self.device, self.loaded.eos_token_ids
        )
        choices = sequence.choices or [sequence]
        with self._inbox.lock:
            if self._inbox.stopping:
                raise EngineStopped("the engine is shutting down")
            if any(choice.request_id in self._requests for choice in choices):
                raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
            limit = self.config.max_waiting + self.config.max_num_seqs
            if len(self._requests) + len(choices) > limit:
                raise EngineOverloaded("too many requests in flight; retry shortly")
            for choice in choices:
                self._requests[choice.request_id] = choice
            self._inbox.post(lambda: self._add(sequence))

    def cancel(self, request_id: str) -> None:
        """Stop a request (all its choices) and free its blocks at the next step boundary."""
        self._inbox.post(lambda: self._cancel(request_id))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream a request's deltas; each choice's last one carries `finish_reason` and
        `usage`, and the stream ends when every choice has ended.

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
        unfinished = request.n
        try:
            while unfinished:
                delta = _delta_or_raise(await deltas.get())
                unfinished -= delta.finish_reason is not None
                yield delta
        finally:
            if unfinished:  # abandoned (or failed: then cancelling is a no-op)
                self.cancel(request.request_id)

    def generate_sync(self, request: GenerationRequest) -> Iterator[GenerationDelta]:
        """`generate` for plain threads: blocks on each delta."""
        self.start()
        deltas: queue.Queue[GenerationDelta | Exception] = queue.Queue()
        self.submit(request, deltas.put)
        unfinished = request.n
        try:
            while unfinished:
                delta = _delta_or_raise(deltas.get())
                unfinished -= delta.finish_reason is not None
                yield delta
        finally:
            if unfinished:
                self.cancel(request.request_id)

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet ended (each choice counts), now."""
        with self._inbox.lock:
            return len(self._requests)

    def queue_depth(self) -> tuple[int, int]:
        """(waiting, running) sequences as of the last step."""
        return self.metrics.waiting, self.metrics.running

    def service_stats(self) -> dict[str, TenantService]:
        """Each tenant's service since start, as of the last step (safe from any thread)."""
        return dict(self.metrics.service)

    def tenant_sequences(self) -> dict[str, int]:
        """Sequences waiting or running per tenant, as of the last step."""
        return dict(self.metrics.tenant_sequences)

    # -- administration -----------------------------------------------------------------------

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        """Change a tenant's (or the public) cache budget now; returns blocks evicted."""
        return self._administer(lambda: self.cache.set_budget(owner, budget))

    def set_budgets(self, budgets: abc.Mapping[Owner, TenantBudget]) -> int:
        """`set_budget` for many owners at one step boundary; returns blocks evicted.

        A budget the pool cannot hold does not stop the others: ValueError names each such
        owner once the rest are set.
        """
        items = list(budgets.items())

        def apply() -> int:
            evicted, refused = 0, []
            for owner, budget in items:
                try:
                    evicted += self.cache.set_budget(owner, budget)
                except ValueError as error:
                    refused.append(f"{owner}: {error}")
            if refused:
                raise ValueError("; ".join(refused))
            return evicted

        return self._administer(apply)

    def purge_tenant(self, tenant_id: str) -> int:
        """A tenant was deleted: refuse its requests (in flight and to come) with
        TenantDeleted, then drop and zero all its cached blocks; returns how many."""
        return self._administer(lambda: self._end_tenant(tenant_id))

    def drop_public_prefix(self, namespace: str, token_ids: abc.Sequence[int]) -> int:
        """Drop and zero the cached blocks of a deleted or disabled public prefix.

        Returns how many blocks were dropped; blocks in use stop matching at once and are
        zeroed when their requests end.
        """
        tokens = list(token_ids)
        return self._administer(lambda: self.cache.drop_public(namespace, tokens))

    def _administer(self, action: Callable[[], int]) -> int:
        """Run an admin action on the engine thread; `cache_stats` shows it once this returns."""

        def run() -> int:
            result = action()
            self._record_queue_and_cache()
            return result

        return self._inbox.call(run)

    def cache_stats(self) -> CacheStats:
        """The cache as of the last step or admin action (safe from any thread)."""
        return self._cache_stats

    def cached_keys(self) -> list[BlockHash]:
        """The key of every block in the prefix cache, without waiting for a running step.

        An idle engine reads them at once; a busy one answers with the keys as of the end of
        the last step after the previous call (the next step's end takes a fresh copy). Scope
        is part of every key, so a router that matches these against a request's own keys can
        never be drawn to another tenant's private blocks.
        """
        if not self.scheduler.has_work():
            return self._inbox.call(self.cache.prefix_cache.keys)
        self._keys_wanted = True
        return self._keys_snapshot

    @property
    def root_key(self) -> BlockHash:
        """The first parent of every key chain (model, adapter, KV dtype and block size)."""
        return self.cache.root


def _delta_or_raise(item: GenerationDelta | Exception) -> GenerationDelta:
    if isinstance(item, Exception):
        raise item
    return item
