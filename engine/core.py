"""The engine's core: each step schedules, runs the model, samples and streams deltas.

Everything here runs on the engine thread (see `inbox.py`), one step at a time: only this thread
changes the cache manager, the scheduler and the model runner. Callers' threads (engine.py) add
to the requests in flight under the inbox's lock, and read what does not change once the engine
is built (the block size, budgets, whether the scheduler has work). A
request ends in one place, `_settle`, whether it finished, failed or was cancelled. Choices 1..n
of a request for n choices wait for choice 0's prompt, then fork off its computed KV and sample
their first tokens from its logits, in the same step.

A step that raises outside any one request's part (a bug, not a request's input) may leave the
cache's bookkeeping half-updated, so none of it is trusted afterwards: every request in flight
fails with a clean error and the engine restarts its state (`_restart`) on the same thread and
the same KV memory, all of it zeroed and free.

`engine.py` builds the face callers use on this core: submitting, streaming, cancelling and
the admin actions.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import Any

import torch

from engine.attention.paged import AttentionBackend
from engine.attention.selection import make_backend
from engine.cache.block_hash import BlockHash, BlockHasher
from engine.cache.block_pool import BlockPool
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.kv_spec import KVSpec, dtype_name
from engine.cache.stats import snapshot
from engine.cache.tier.backends import make_tier
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.speed import TierSpeed
from engine.cache.tier_link import TierLink
from engine.config import EngineConfig, TierConfig
from engine.errors import EngineError, EngineRestarted, RequestFailed, TenantDeleted
from engine.fault_isolation import run_isolated
from engine.inbox import Inbox
from engine.metrics import EngineMetrics
from engine.model.gpu_memory import kv_cache_budget, largest_step_bytes
from engine.model.loader import LoadedModel
from engine.model.openmp import ThreadGovernor
from engine.model.runner import Chunk, ModelRunner
from engine.request import GenerationDelta
from engine.sampling.sampler import TokenLogprobs
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, Status
from engine.step_cost import CostFit, StepCost, attended_pairs, calibrate
from engine.step_sampling import sample_next, take_prompt_logprobs

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # on a CPU


class EngineCore:
    """Steps one model's requests on a paged, prefix-cached KV pool."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        model = loaded.model
        self.device = next(model.parameters()).device
        kv_dtype = config.kv_dtype or model.dtype
        spec = KVSpec(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, kv_dtype, config.block_size
        )
        self.max_model_len = config.max_model_len or loaded.max_model_len
        backend = make_backend(config.attention_backend, self.device, loaded.head_dim)
        num_blocks = config.num_blocks or max(
            1, self._kv_cache_bytes(spec, backend) // spec.bytes_per_block
        )
        # Restarts after a crashed step (see `_restart`), and the wall-clock time of the last.
        self.restarts = 0
        # Seconds the engine thread's warm-up took before it served (0: not run yet).
        self.warm_up_s = 0.0
        self.last_restart_at: float | None = None
        self._restarting = False
        pool = BlockPool(spec, num_blocks, self.device, backend.zero_blocks)
        self.runner = ModelRunner(model, pool.kv, backend)
        hasher = BlockHasher(config.block_size)
        self.root = hasher.root(loaded.fingerprint, config.adapter_id, dtype_name(kv_dtype))
        # Fewer CPU threads while something else wants the CPUs (None: nothing to govern).
        self.threads = ThreadGovernor.for_device(self.device)
        # The cost model steps are predicted with: calibrated now, then refitted from every step
        # (engine/step_cost.py); one given in the config is used as is.
        calibrated = config.step_cost or self._calibrate(pool, kv_dtype)
        self.cost_fit = CostFit(calibrated, follow=config.step_cost is None)
        # The second tier, its speed measured now, before the engine says it is ready.
        self.kv_tier: KVTier | None = None
        self.tier_speed: TierSpeed | None = None
        if config.kv_tier is not None:
            self.kv_tier = self._open_tier(config.kv_tier, spec)
            self.tier_speed = self.kv_tier.calibrate()
        self._install(pool)
        logger.info("engine: %s", self.describe())
        self.metrics = EngineMetrics()
        self._inbox = Inbox()
        # Every request in flight, from `submit` until `_settle`, guarded by the inbox's lock.
        self._requests: dict[str, Sequence] = {}
        # Tenants deleted (`_end_tenant`): a request of theirs that reaches the engine thread
        # later (it passed the gateway's key check before the deletion) is refused, never
        # served, so nothing of a deleted tenant is cached again. Kept across restarts, and
        # never emptied: a tenant's id (a UUID) is never given to another tenant.
        self._deleted_tenants: set[str] = set()
        self._cache_stats = snapshot(self.cache)
        # The prefix cache's keys for `cached_keys`, copied at a step's end when asked for.
        self._keys_snapshot: list[BlockHash] = []
        self._keys_wanted = False

    def _install(self, pool: BlockPool) -> None:
        """Serve from `pool` with a new cache manager and scheduler: nothing cached, nobody
        scheduled, the configured public and default budgets, tenants' budgets to come with
        their requests."""
        config = self.config
        self.pool = pool
        self.cache = KVCacheManager(
            pool,
            BlockHasher(config.block_size),
            self.root,
            public_budget=config.public_budget,
            default_budget=config.default_budget,
            enable_prefix_caching=config.enable_prefix_caching,
            eviction=config.eviction,
            block_cost=self._block_cost,
        )
        if self.kv_tier is not None:
            link = TierLink(self.kv_tier, pool, self.root, self._block_cost, config.eviction)
            link.speed = self.tier_speed
            self.cache.attach_tier(link)
        self.scheduler = Scheduler(
            self.cache,
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                queue_timeout_s=config.queue_timeout_s,
                fair=config.scheduling == "fair",
            ),
        )
        self.scheduler.service_cost = self.cost_fit.calibrated

    def _open_tier(self, tier: TierConfig, spec: KVSpec) -> KVTier:
        return make_tier(
            tier.kind,
            spec=spec,
            root=self.root,
            capacity_bytes=tier.capacity_bytes,
            directory=tier.directory,
            worker_name=tier.worker_name,
            redis_url=tier.redis_url,
            key_prefix=tier.key_prefix,
        )

    def _block_cost(self, index: int) -> float:
        """What recomputing block `index` of a prompt costs now, in ms: its tokens through the
        projections and their attention over the positions before them."""
        size = self.config.block_size
        return self.step_cost.tokens_ms(size, attended_pairs(index * size, size))

    def _calibrate(self, pool: BlockPool, kv_dtype: torch.dtype) -> StepCost:
        """The cost model of this model on this machine (engine/step_cost.py), timed now on
        the empty pool unless this process already timed the same set-up."""
        threads = self.threads.all_threads if self.threads else torch.get_num_threads()
        key = (
            self.loaded.fingerprint,
            str(self.device),
            self.loaded.model.dtype,
            kv_dtype,
            self.runner.backend.name,
            self.runner.matrix_linears,
            pool.spec.block_size,
            threads,
        )
        return calibrate(self.runner, pool, key, threads)

    @property
    def step_cost(self) -> StepCost:
        """The cost model as fitted so far."""
        return self.cost_fit.model

    @property
    def step_target_ms(self) -> float:
        """The step-time target: the configured one, else `CostFit.target_ms`."""
        return self.config.step_target_ms or self.cost_fit.target_ms()

    def _computing_threads(self) -> int:
        """The CPU threads the next step computes with (the governor's count where it governs)."""
        return self.threads.threads if self.threads else self.step_cost.threads

    def _kv_cache_bytes(self, spec: KVSpec, backend: AttentionBackend) -> int:
        """The pool's size when no block count is configured (see `EngineConfig`)."""
        config = self.config
        if config.kv_cache_bytes is not None:
            return config.kv_cache_bytes
        if self.device.type != "cuda":
            return DEFAULT_KV_CACHE_BYTES
        # The sampler's logits and probabilities for a full batch, in fp32.
        logits = 2 * 4 * config.max_num_seqs * self.loaded.vocab_size
        activations = largest_step_bytes(
            self.loaded.model, spec, backend, config.max_num_batched_tokens, self.max_model_len
        )
        return kv_cache_budget(self.device, config.gpu_memory_fraction, activations + logits)

    def describe(self) -> dict[str, Any]:
        """What serves (model, device, dtypes, attention backend, pool size), and how often its
        state restarted after a crashed step (`last_restart_at`: Unix time, or None)."""
        return {
            "model": self.loaded.name,
            "device": str(self.device),
            "dtype": dtype_name(self.loaded.model.dtype),
            "kv_dtype": dtype_name(self.pool.spec.dtype),
            "logits_dtype": "float32"
            if self.runner.fp32_logits
            else dtype_name(self.loaded.model.dtype),
            "attention_backend": self.runner.backend.name,
            # "matrix": every projection and the LM head in one order of arithmetic
            # (engine.kernels.cpu.linear.MatrixLinear); "library": some or all on oneDNN's or
            # torch's products, whose order depends on the row count.
            "linear_kernel": "matrix" if self.runner.matrix_linears else "library",
            "kv_blocks": self.pool.num_blocks,
            "kv_tier": self._describe_tier(),
            "warm_up_s": round(self.warm_up_s, 3),
            "restarts": self.restarts,
            "last_restart_at": self.last_restart_at,
            "scheduling": self.config.scheduling,
            # None where nothing is governed (a GPU, one thread, threads that sleep when idle).
            "cpu_threads": self.threads.describe() if self.threads else None,
            "step_cost": {
                **self.step_cost.describe(),
                "target_ms": round(self.step_target_ms, 3),
                "threads": self._computing_threads(),
                "fitted_steps": self.cost_fit.steps,
                "calibrated": self.cost_fit.calibrated.describe(),
            },
        }

    def _describe_tier(self) -> dict[str, Any] | None:
        """The second tier, its calibrated speed, and what the cost rule decided so far."""
        if self.kv_tier is None or self.tier_speed is None:
            return None
        link = self.cache.tier
        stats = self.kv_tier.snapshot()
        counters = [owner.counters for owner in stats.owners.values()]
        return {
            "kind": self.kv_tier.store.kind,
            "capacity_bytes": self.kv_tier.store.capacity_bytes,
            "latency_ms": round(self.tier_speed.latency_ms, 3),
            "bytes_per_s": round(self.tier_speed.bytes_per_s),
            # The calibrated rule for one block at a prompt's start: read it back, or compute it.
            "block_load_ms": round(self.tier_speed.load_ms(self.pool.spec.bytes_per_block), 3),
            "block_compute_ms": round(self._block_cost(0), 3),
            "loaded_blocks": 0 if link is None else link.loaded_blocks,
            "recomputed_blocks": 0 if link is None else link.recomputed_blocks,
            # This engine's traffic with the store, every owner together.
            "queued": stats.queued,
            "offloaded_blocks": sum(c.offloads for c in counters),
            "offloaded_bytes": sum(c.offloaded_bytes for c in counters),
            "dropped": dict(sum((c.drops for c in counters), Counter())),
            "missed": dict(sum((c.misses for c in counters), Counter())),
            "held_bytes": stats.used_bytes,
        }

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one scheduling step on the calling thread; returns whether there was work."""
        self._inbox.drain()
        if not self.scheduler.has_work():
            # The drain may have ended the last requests (a cancel, a purge): with nothing left
            # to step, this is the last chance to report the empty queue before the thread sleeps.
            self._record_queue_and_cache()
            return False
        started = time.perf_counter()
        threads = self._computing_threads()
        output = self.scheduler.schedule(threads, self.step_cost, self.step_target_ms)
        for sequence, error in output.failed:
            self._settle(sequence, error)
        tokens = sum(chunk.num_tokens for chunk in output.chunks)
        if output.chunks:
            with self.threads.step(tokens) if self.threads else contextlib.nullcontext():
                self._execute(output)
        self.cache.end_step()
        self._cache_stats = snapshot(self.cache)
        if self._keys_wanted:
            self._keys_wanted = False
            self._keys_snapshot = self.cache.prefix_cache.keys()
        elapsed = time.perf_counter() - started
        self.cost_fit.observe(tokens, output.pairs, threads, elapsed * 1000.0)
        self.metrics.record_step(
            elapsed,
            tokens,
            output.preempted,
            len(self.scheduler.waiting),
            len(self.scheduler.running),
        )
        self.metrics.record_service(
            (chunk.sequence.request.tenant_id, chunk.num_tokens, chunk.decode, chunk.service)
            for chunk in output.chunks
        )
        self.metrics.tenant_sequences = self.scheduler.tenant_sequences()
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
        logits = step.logits()
        if any(chunk.all_logits for chunk in chunks):
            logits = take_prompt_logprobs(scheduled, chunks, step.failed, logits)
        # Rows for the choices that fork off a prompt computed in this step, copied before
        # sampling changes the logits in place.
        forks = [(parent, child) for parent in sampled for child in parent.forks]
        fork_rows = [row for row, parent in enumerate(sampled) for _ in parent.forks]
        fork_logits = logits[fork_rows] if logits is not None and fork_rows else None
        tokens, logprobs = sample_next(logits, sampled)
        for sequence, token in zip(sampled, tokens, strict=True):
            if isinstance(token, EngineError):
                failures[sequence] = token
        for sequence, error in failures.items():
            self._settle(sequence, error)  # before commit: its blocks are never cached
        for item in scheduled:
            if item.sequence not in failures:
                item.sequence.num_computed += item.num_tokens
                self.cache.commit(item.sequence.request_id, item.sequence.num_computed)
        forked, fork_tokens, fork_logprobs = self._fork(forks, fork_logits)
        for sequence, token in zip(forked, fork_tokens, strict=True):
            if isinstance(token, EngineError):
                self._settle(sequence, token)
        for sequence, token, token_logprobs in zip(
            sampled + forked, tokens + fork_tokens, logprobs + fork_logprobs, strict=True
        ):
            if isinstance(token, int):
                try:
                    self._append(sequence, token, token_logprobs)
                except Exception:  # handling one request's output fails that request only
                    logger.exception("handling a request's output failed")
                    self._settle(sequence, RequestFailed("handling this request's output failed"))

    def _fork(
        self, forks: list[tuple[Sequence, Sequence]], logits: torch.Tensor | None
    ) -> tuple[list[Sequence], list[int | RequestFailed], list[TokenLogprobs | None]]:
        """Start each (parent, child) choice on the prompt its parent computed in this step,
        sharing its blocks, and sample its first token from the parent's logits (`logits`
        has one row per pair).

        Returns the children that run now; one that cannot fork now waits as a request of
        its own. Children of a parent that failed were settled with it.
        """
        forked: list[Sequence] = []
        rows: list[int] = []
        for row, (parent, child) in enumerate(forks):
            parent.forks = []
            runs = parent.status is Status.RUNNING and child.status is Status.WAITING
            if runs and self.scheduler.fork(parent, child):
                forked.append(child)
                rows.append(row)
        if logits is None or not forked:
            return [], [], []
        tokens, logprobs = sample_next(logits[rows], forked)
        return forked, tokens, logprobs

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
            all_logits=sequence.wants_prompt_logits,
            share_group=sequence.request.tenant_id,  # never another tenant's: see Chunk
        )

    def _append(
        self, sequence: Sequence, token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        first = sequence.first_token_at is None
        if sequence.grammar is not None and not sequence.grammar.accept(token):
            raise RuntimeError(f"token {token} is outside the request's grammar")
        delta = sequence.append(token, self.loaded.eos_token_ids, self.max_model_len, logprobs)
        if sequence.output_counts is not None:
            sequence.output_counts[token] += 1
        self.cache.append_tokens(sequence.request_id, [token])
        if first and sequence.first_token_at is not None:
            self.metrics.record_ttft(sequence.first_token_at - sequence.arrival)
        if delta.finish_reason is None:
            sequence.sink(delta)
        else:
            self._settle(sequence, delta)

    def _record_queue_and_cache(self) -> None:
        """Record the queue depth and cache stats as they are now, for a step that ran no
        work or an admin action: otherwise `queue_depth` and `cache_stats` tell of the past."""
        self._cache_stats = snapshot(self.cache)
        self.metrics.waiting = len(self.scheduler.waiting)
        self.metrics.running = len(self.scheduler.running)
        self.metrics.tenant_sequences = self.scheduler.tenant_sequences()

    # -- requests coming and going ------------------------------------------------------------

    def _add(self, sequence: Sequence) -> None:
        """Hand a new request to the scheduler; its other choices wait for its prompt."""
        with self._inbox.lock:
            if self._requests.get(sequence.request_id) is not sequence:
                return  # a restart failed it while it waited in the inbox
        if sequence.request.tenant_id in self._deleted_tenants:
            # Still in the inbox when its tenant was deleted: refused before it holds a block
            # (its other choices, waiting on its prompt, share its end).
            self._settle(sequence, _tenant_deleted())
            return
        self.scheduler.add(sequence)
        for fork in sequence.forks:
            fork.status = Status.WAITING

    def _cancel(self, request_id: str) -> None:
        with self._inbox.lock:
            sequence = self._requests.get(request_id)
        # One still in the inbox was submitted after this cancel was queued: not the one meant.
        if sequence is not None and sequence.status is not Status.SUBMITTED:
            for choice in sequence.choices or [sequence]:
                self._settle(choice, None)

    def _end_tenant(self, tenant_id: str) -> int:
        """A tenant was deleted: refuse its requests in flight and any that arrive later
        (`TenantDeleted`), then drop and zero its cached blocks; returns how many."""
        self._deleted_tenants.add(tenant_id)
        for sequence in self._scheduled():
            if sequence.request.tenant_id == tenant_id:
                self._settle(sequence, _tenant_deleted())
        if self.kv_tier is not None:
            self.kv_tier.forget_owner(tenant_id)
        return self.cache.purge(tenant_id)

    def _scheduled(self) -> list[Sequence]:
        """The requests in flight that the scheduler has taken.

        Those still in the inbox are left out: they were submitted after the action now running
        was queued, and their turn comes after it.
        """
        with self._inbox.lock:
            in_flight = list(self._requests.values())
        return [sequence for sequence in in_flight if sequence.status is not Status.SUBMITTED]

    def _settle(self, sequence: Sequence, outcome: GenerationDelta | EngineError | None) -> None:
        """End a request once: free its blocks, unregister it, send its last delta or error.

        `outcome` is the last delta (finished), an error (failed) or None (cancelled: nobody is
        listening).
        """
        with self._inbox.lock:
            if self._requests.get(sequence.request_id) is not sequence:
                return  # already settled
            del self._requests[sequence.request_id]
        # Choices still waiting for this one's prompt share its end (it never ends normally
        # before they fork: they fork where it samples its first token).
        pending, sequence.forks = sequence.forks, []
        for fork in pending:
            self._settle(fork, outcome if isinstance(outcome, EngineError) else None)
        # A failed request's KV may be what failed it: none of it stays cached.
        self.scheduler.remove(sequence, keep_computed=not isinstance(outcome, EngineError))
        computed_prompt_positions = self.runner.pop_computed_prompt_positions(sequence.request_id)
        if outcome is None:
            self.metrics.cancelled += 1
            return
        if isinstance(outcome, GenerationDelta):
            usage = sequence.usage(computed_prompt_positions, self.config.block_size)
            self.metrics.record_finish(usage)
            outcome = sequence.final_delta(outcome, usage)
        try:
            sequence.sink(outcome)
        except Exception:  # the request is over either way; the engine must go on
            logger.exception("a request's sink raised on its last item")

    # -- restarting after a crashed step ------------------------------------------------------

    def _step_or_restart(self) -> None:
        """A step on the engine thread; a failure outside any one request's part restarts."""
        try:
            self.step()
        except Exception:  # the last resort
            logger.exception("engine step failed; failing all in-flight requests and restarting")
            self._restart()

    def _restart(self) -> None:
        """Serve from a fresh cache manager and scheduler over the same KV memory, all of it
        zeroed and free (after a crashed step the cache's bookkeeping, and so every cached
        prefix, is untrusted), then fail every request that was in flight.

        The requests learn of their failure only once the engine serves again.
        """
        with self._inbox.lock:
            in_flight, self._requests = list(self._requests.values()), {}
        self._restarting = True
        try:
            self._install(self.pool.fresh())  # the same memory, never held twice
            self._record_queue_and_cache()
            self.restarts += 1
            self.last_restart_at = time.time()
            logger.warning("engine state restarted (%d restarts so far)", self.restarts)
        finally:
            self._restarting = False
            self._fail(in_flight, EngineRestarted("the engine failed and restarted; retry"))

    def _fail(self, sequences: list[Sequence], error: EngineError) -> None:
        """Send `error` to requests already unregistered, touching neither cache nor scheduler."""
        for sequence in sequences:
            self.runner.pop_computed_prompt_positions(sequence.request_id)
            try:
                sequence.sink(error)
            except Exception:  # the request is over either way; the restart must go on
                logger.exception("a request's sink raised on its last item")


def _tenant_deleted() -> TenantDeleted:
    return TenantDeleted("the tenant was deleted; its requests are refused")
