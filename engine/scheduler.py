"""The scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step's token budget is shared fairly between the tenants with work: each gets an equal
share first, and what a tenant cannot use goes to the others afterwards, so that one tenant's
flood of long prompts neither fills every step nor keeps another tenant's request waiting.
Within its share, a tenant's running sequences go first (decodes, which always run, and
unfinished prefill chunks), then its waiting sequences are admitted, the least-served tenant's
first and each tenant's in arrival order, while the sequence limit and the cache allow. While
other sequences run or wait, no prefill chunk takes more than `long_prefill_tokens` of a step,
so one long prompt cannot hold the whole budget for steps on end. When a running sequence
cannot get a block, the newest running sequence that competes for the same blocks is preempted
(its blocks freed, recomputed later, mostly from the prefix cache); a waiting sequence whose
blocks stay refused past the queue timeout fails with a typed error.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.budget import PUBLIC_OWNER, PoolExhausted, QuotaExceeded, Refusal
from engine.cache.kv_cache_manager import KVCacheManager
from engine.errors import CacheQuotaTimeout, EngineError, PoolTimeout
from engine.sequence import Sequence, Status

# Most tokens per chunk of a request that wants logits at every prompt position: its logits
# take vocabulary x 4 bytes per token (about 50 MB for a 49k vocabulary).
PROMPT_LOGITS_CHUNK = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    queue_timeout_s: float = 30.0
    long_prefill_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass(slots=True)
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    failed: list[tuple[Sequence, EngineError]] = field(default_factory=list)
    preempted: int = 0


class Scheduler:
    """Decides, each step, which sequences compute how many tokens."""

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.config = config
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, sequence: Sequence) -> None:
        sequence.status = Status.WAITING
        sequence.waiting_since = self.clock()
        self.waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, sequence: Sequence, keep_computed: bool = True) -> None:
        """Take a sequence out (finished, failed or cancelled) and free its blocks now.

        Without `keep_computed` the blocks it computed are not left in the prefix cache.
        """
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.manager.free(sequence.request_id, keep_computed)
        sequence.status = Status.FINISHED

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if len(self.waiting) + len(self.running) > 1:  # others share the step
            per_prefill = min(budget, self.config.long_prefill_tokens)
        else:
            per_prefill = budget
        shares = _Shares(budget, self.running, self.waiting)
        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            decode = sequence.num_tokens - sequence.num_computed == 1
            allowed = min(budget, per_prefill, max(shares.left(sequence), int(decode)))
            if allowed <= 0:  # its tenant's share is spent: it may get leftovers below
                index += 1
                continue
            count = _chunk_size(sequence, sequence.num_computed, allowed)
            if self._grow(sequence, count, index, output):
                output.chunks.append(ScheduledChunk(sequence, count))
                shares.use(sequence, count)
                budget -= count
                index += 1
        if output.preempted:
            return output  # memory is tight: let the running sequences finish first
        over_share: list[Sequence] = []
        candidates = _fair_order(self.waiting, self.running)
        budget = self._admit_waiting(candidates, output, budget, per_prefill, shares, over_share)
        budget = self._give_leftovers(output, budget, per_prefill)
        self._admit_waiting(over_share, output, budget, per_prefill, None, [])
        return output

    def _admit_waiting(
        self,
        candidates: list[Sequence],
        output: SchedulerOutput,
        budget: int,
        per_prefill: int,
        shares: _Shares | None,
        over_share: list[Sequence],
    ) -> int:
        """Admit `candidates` in order, each within its tenant's share (any size without
        `shares`); those whose tenant's share is spent go to `over_share`, to be tried again
        with leftovers. Returns the budget left."""
        for sequence in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            allowed = min(budget, per_prefill, shares.left(sequence) if shares else budget)
            if allowed <= 0:
                over_share.append(sequence)
                continue
            count = self._admit(sequence, allowed, output)
            if count:
                output.chunks.append(ScheduledChunk(sequence, count))
                if shares:
                    shares.use(sequence, count)
                budget -= count
        return budget

    def _give_leftovers(self, output: SchedulerOutput, budget: int, per_prefill: int) -> int:
        """Give the budget no tenant used within its share to running prefills that their
        tenant's share cut short or left out, in order, where the cache has the blocks now
        (no preemption for leftovers); returns the budget left."""
        chunks = {id(chunk.sequence): chunk for chunk in output.chunks}
        for sequence in self.running:
            if budget <= 0:
                break
            chunk = chunks.get(id(sequence))
            scheduled = chunk.num_tokens if chunk else 0
            count = _chunk_size(
                sequence, sequence.num_computed, min(per_prefill, scheduled + budget)
            )
            if count <= scheduled:
                continue
            if self.manager.allocate(sequence.request_id, sequence.num_computed + count):
                continue  # refused: the blocks are not there without preempting someone
            if chunk is None:
                output.chunks.append(ScheduledChunk(sequence, count))
            else:
                chunk.num_tokens = count
            budget -= count - scheduled
        return budget

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start `child` on `parent`'s just-computed prompt, sharing its KV blocks.

        Returns whether it runs now; when the batch is full or the cache refuses the fork,
        it waits as a request of its own instead (and computes the prompt itself, from the
        prefix cache where its scopes allow).
        """
        if len(self.running) < self.config.max_num_seqs:
            refusal = self.manager.fork(parent.request_id, child.cache_request, child.key_chain)
            if refusal is None:
                self.running.append(child)
                child.status = Status.RUNNING
                child.num_computed = parent.num_computed
                child.admitted_wall = parent.admitted_wall
                child.prompt_logprobs = parent.prompt_logprobs
                return True
        self.add(child)
        return False

    def _grow(self, sequence: Sequence, count: int, index: int, output: SchedulerOutput) -> bool:
        """Give a running sequence blocks for `count` more tokens, preempting if needed."""
        while True:
            refusal = self.manager.allocate(sequence.request_id, sequence.num_computed + count)
            if refusal is None:
                return True
            victim = self._victim(refusal, sequence, index)
            self._preempt(victim)
            output.preempted += 1
            if victim is sequence:
                return False

    def _victim(self, refusal: Refusal, sequence: Sequence, index: int) -> Sequence:
        """The newest running sequence after `index` whose blocks would help, else `sequence`."""
        for candidate in reversed(self.running[index + 1 :]):
            if isinstance(refusal, PoolExhausted):
                return candidate
            if candidate.request.tenant_id == sequence.request.tenant_id:
                return candidate
        return sequence

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self.manager.free(sequence.request_id)
        sequence.num_computed = 0
        sequence.status = Status.WAITING
        sequence.waiting_since = self.clock()
        self.waiting.appendleft(sequence)

    def _admit(self, sequence: Sequence, budget: int, output: SchedulerOutput) -> int:
        """Admit a waiting sequence for a first chunk; returns its size, 0 if it must wait."""
        hit = self.manager.match(
            sequence.cache_request, sequence.key_chain, reuse=sequence.reuses_cache
        )
        count = _chunk_size(sequence, hit.cached_tokens, budget)
        refusal = self.manager.admit(hit, count)
        if refusal is not None:
            if self.clock() - sequence.waiting_since > self.config.queue_timeout_s:
                self.waiting.remove(sequence)
                sequence.status = Status.FINISHED
                output.failed.append((sequence, _timeout_error(refusal, self.config)))
            return 0
        self.waiting.remove(sequence)
        self.running.append(sequence)
        sequence.status = Status.RUNNING
        sequence.num_computed = hit.cached_tokens
        if sequence.admitted_wall is None:  # first admission (not a re-entry after preemption)
            sequence.admitted_wall = time.time()
        return count


class _Shares:
    """Each tenant's equal share of a step's token budget, and how much of it is used."""

    def __init__(self, budget: int, running: list[Sequence], waiting: deque[Sequence]) -> None:
        tenants = {sequence.request.tenant_id for sequence in (*running, *waiting)}
        self.share = budget // max(1, len(tenants))
        self.used: Counter[str] = Counter()

    def left(self, sequence: Sequence) -> int:
        return self.share - self.used[sequence.request.tenant_id]

    def use(self, sequence: Sequence, tokens: int) -> None:
        self.used[sequence.request.tenant_id] += tokens


def _fair_order(waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
    """Waiting sequences, the tenants with the fewest sequences running first and in turns
    (each tenant's k-th waiting sequence counts as its running + k-th), each tenant's in
    arrival order."""
    load = Counter(sequence.request.tenant_id for sequence in running)
    keys = {}
    for position, sequence in enumerate(waiting):
        tenant = sequence.request.tenant_id
        keys[id(sequence)] = (load[tenant], position)
        load[tenant] += 1
    return sorted(waiting, key=lambda sequence: keys[id(sequence)])


def _chunk_size(sequence: Sequence, num_computed: int, budget: int) -> int:
    """Tokens to compute next for a sequence with `num_computed` computed, within `budget`."""
    count = min(sequence.num_tokens - num_computed, budget)
    if sequence.wants_prompt_logits:
        count = min(count, PROMPT_LOGITS_CHUNK)
    return count


def _timeout_error(refusal: Refusal, config: SchedulerConfig) -> EngineError:
    waited = f"after waiting {config.queue_timeout_s:g} s"
    if isinstance(refusal, QuotaExceeded):
        # Never the owner's id: it is internal, and the caller names the tenant its own way.
        budget = "public cache budget" if refusal.owner is PUBLIC_OWNER else "tenant's cache quota"
        return CacheQuotaTimeout(
            f"the {budget} stayed full {waited}: {refusal.active_blocks} of its "
            f"{refusal.quota_blocks} blocks are in use and {refusal.needed_blocks} more are needed"
        )
    return PoolTimeout(f"{refusal} {waited}")
