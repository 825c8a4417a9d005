"""The scheduler: continuous batching with chunked prefill under a per-step token budget,
shared fairly between tenants over time and kept short while another tenant waits on it.

Each step's token budget is shared between the tenants with work by their service so far
(engine/fairness.py): the least-served tenants are served first, each up to what it can use,
and what one cannot use goes to the others. Within a tenant, its running sequences go first
(decodes, which always run, then unfinished prefill chunks), then its waiting sequences are
admitted in arrival order, while the sequence limit and the cache allow. While other sequences
run or wait, no prefill chunk takes more than `long_prefill_tokens` of a step.

Short steps while others wait on them: when a step would carry one tenant's prefill while
another tenant has light work (a decode, or a prompt short enough for one target step) now or
had some within `light_recent_s`, and that tenant is not more than a step's budget ahead in
service, the step's prefill tokens are cut so that its predicted time (engine/step_cost.py, on
the threads the engine computes with now) stays within the step-time target. Decodes always
run; short prompts come first, then the rest least-served tenant first, and the least-served
tenant's prompt gets `MIN_CAPPED_PREFILL_TOKENS` even when the rest fills the target. A tenant
with no other tenant's light work in that window keeps the whole budget.

When a running sequence cannot get a block, the newest running sequence not yet scheduled in
the step that competes for the same blocks is preempted (its blocks freed, recomputed later,
mostly from the prefix cache), except that a prefill waits a step rather than preempt for
blocks a sequence admitted in the same step took; a waiting sequence whose blocks stay refused
past the queue timeout fails with a typed error. Seats (`max_num_seqs`) go in arrival order.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.budget import PUBLIC_OWNER, PoolExhausted, QuotaExceeded, Refusal, ShareExceeded
from engine.cache.kv_cache_manager import KVCacheManager
from engine.errors import CacheQuotaTimeout, EngineError, PoolTimeout
from engine.fairness import FairShare
from engine.sequence import Sequence, Status
from engine.step_cost import StepCost, attended_pairs

# Most tokens per chunk of a request that wants logits at every prompt position: its logits
# take vocabulary x 4 bytes per token (about 50 MB for a 49k vocabulary).
PROMPT_LOGITS_CHUNK = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    queue_timeout_s: float = 30.0
    long_prefill_tokens: int = 512
    # Service counted over time and steps kept short ("fair"), or each step's budget split
    # equally ("per_step").
    fair: bool = True
    # How long a tenant's light work keeps other tenants' steps short after it ended.
    light_recent_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass(slots=True)
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int
    # What it costs its tenant's service counter (engine/fairness.py), set once the step is
    # planned, and whether it is a decode.
    service: float = 0.0
    decode: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    failed: list[tuple[Sequence, EngineError]] = field(default_factory=list)
    preempted: int = 0
    # The (token, position) pairs its attention reads, its predicted time (ms, on the threads
    # of `schedule`) and whether it was kept within the step-time target.
    pairs: int = 0
    predicted_ms: float = 0.0
    capped: bool = False


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
        # The cost model and step-time target of the step being planned.
        self.cost: StepCost | None = None
        self.target_ms: float | None = None
        # The model service is weighed with (the calibrated one: a step's refit must not
        # change what a token counts for); None: the step's own.
        self.service_cost: StepCost | None = None
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fair = FairShare(config.max_num_batched_tokens, remember=config.fair)
        self._light_seen: dict[str, float] = {}  # tenant -> when it last had light work
        # What fits in one target step, and the tenants counted light (set each step a cap
        # could apply).
        self._short_tokens = 1
        self.light: set[str] = set()

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

    def tenant_sequences(self) -> dict[str, int]:
        """Sequences waiting or running, per tenant."""
        return dict(Counter(s.request.tenant_id for s in (*self.running, *self.waiting)))

    def schedule(
        self, threads: int = 1, cost: StepCost | None = None, target_ms: float | None = None
    ) -> SchedulerOutput:
        """The next step's chunks; `threads`: the CPU threads it will compute with, `cost`: the
        model its time is predicted with (None: service counted in tokens), `target_ms`: the
        step-time target (None: no cap; never with "per_step" scheduling)."""
        self.cost = cost
        self.target_ms = target_ms if self.config.fair else None
        self.fair.begin_step(self._weights())
        budget = self.config.max_num_batched_tokens
        if len(self.waiting) + len(self.running) > 1:  # others share the step
            per_prefill = min(budget, self.config.long_prefill_tokens)
        else:
            per_prefill = budget
        step = _Step(self, budget, per_prefill, threads)
        step.run_decodes()
        step.run_prefills(_fair_order(self.waiting, self.running, self.fair))
        if not step.output.preempted:  # else memory is tight: the running finish first
            step.give_leftovers()
            step.admit_waiting(step.over_share, shares=False)
        return step.finish()

    def _weights(self) -> dict[str, float]:
        """Each tenant with work and its weight, as its latest request says."""
        weights: dict[str, float] = {}
        for sequence in (*self.running, *self.waiting):
            weights[sequence.request.tenant_id] = sequence.request.weight
        return weights

    def _time_cap_ms(self, per_prefill: int, threads: int) -> float | None:
        """The step-time target when this step must stay short, else None (see the module
        docstring)."""
        if self.target_ms is None or self.cost is None:
            return None
        now = self.clock()
        self._short_tokens = self._fitting_alone(per_prefill, threads)
        prefilling: set[str] = set()
        for sequence in (*self.running, *self.waiting):
            tenant = sequence.request.tenant_id
            if self.is_short(sequence):  # a decode, or a prompt one target step computes
                self._light_seen[tenant] = now
            if not _decodes(sequence):
                prefilling.add(tenant)
        recent = self.config.light_recent_s
        self._light_seen = {t: at for t, at in self._light_seen.items() if now - at <= recent}
        # A tenant more than a step's budget ahead of the prefilling ones is not waited for:
        # many short requests make a tenant light one by one, never short of service.
        ahead = min((self.fair.counter(t) for t in prefilling), default=0.0) + self.fair.slack
        light = self.light = {t for t in self._light_seen if self.fair.counter(t) <= ahead}
        if any(light - {tenant} for tenant in prefilling):
            return self.target_ms
        return None

    def _fitting_alone(self, per_prefill: int, threads: int) -> int:
        """Most prompt tokens (up to `per_prefill`) a step of their own computes within the
        target, on `threads` threads (at least one)."""
        cost, target = self.cost, self.target_ms
        if cost is None or target is None:
            return per_prefill
        fixed = cost.fixed_ms * cost.thread_factor(threads)
        return max(1, cost.fitting_tokens(target - fixed, 0, threads, per_prefill))

    def is_short(self, sequence: Sequence) -> bool:
        """Whether what the sequence has left to compute fits in one target step: a decode, or
        a short prompt (as of the last `_time_cap_ms`)."""
        return sequence.num_tokens - sequence.num_computed <= self._short_tokens

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

    def _grow(
        self, sequence: Sequence, count: int, protected: set[int]
    ) -> tuple[bool, list[Sequence]]:
        """Give a running sequence blocks for `count` more tokens, preempting if needed (never
        a sequence in `protected`: scheduled already); returns whether it got them, and the
        sequences preempted."""
        preempted: list[Sequence] = []
        while True:
            refusal = self.manager.allocate(sequence.request_id, sequence.num_computed + count)
            if refusal is None:
                return True, preempted
            victim = self._victim(refusal, sequence, protected)
            self._preempt(victim)
            preempted.append(victim)
            if victim is sequence:
                return False, preempted

    def _victim(self, refusal: Refusal, sequence: Sequence, protected: set[int]) -> Sequence:
        """The newest running sequence newer than `sequence` and not protected whose blocks
        would help, else `sequence`.

        Past its quota or its share of the pool, a tenant makes room only from its own
        sequences: another tenant's would help the pool, but not within that tenant's limit.
        """
        newer = self.running[self.running.index(sequence) + 1 :]
        for candidate in reversed(newer):
            if id(candidate) in protected:
                continue
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

    def _admit(
        self, sequence: Sequence, limit: Callable[[int], int], output: SchedulerOutput
    ) -> tuple[int, bool]:
        """Admit a waiting sequence for a first chunk of at most `limit(cached tokens)`
        tokens; returns its size (0: it waits) and whether the cache refused it."""
        hit = self.manager.match(
            sequence.cache_request, sequence.key_chain, reuse=sequence.reuses_cache
        )
        count = limit(hit.cached_tokens)
        if count <= 0:
            return 0, False
        refusal = self.manager.admit(hit, count)
        if refusal is not None:
            if self.clock() - sequence.waiting_since > self.config.queue_timeout_s:
                self.waiting.remove(sequence)
                sequence.status = Status.FINISHED
                output.failed.append((sequence, _timeout_error(refusal, self.config)))
            return 0, True
        self.waiting.remove(sequence)
        self.running.append(sequence)
        sequence.status = Status.RUNNING
        sequence.num_computed = hit.cached_tokens
        if sequence.admitted_wall is None:  # first admission (not a re-entry after preemption)
            sequence.admitted_wall = time.time()
        return count, False


# Under a step-time cap, the least-served tenant's prefill still gets this many tokens when the
# rest of the step fills the target: a heavy tenant slows down, it never stops.
MIN_CAPPED_PREFILL_TOKENS = 16


class _Step:
    """One step being planned: its budget, each tenant's share of it, its time cap, and the
    chunks so far."""

    def __init__(self, scheduler: Scheduler, budget: int, per_prefill: int, threads: int) -> None:
        self.scheduler = scheduler
        self.fair = scheduler.fair
        self.cost = scheduler.cost
        self.budget = budget
        self.per_prefill = per_prefill
        self.threads = threads
        self.cap_ms = scheduler._time_cap_ms(per_prefill, threads)
        self.output = SchedulerOutput(capped=self.cap_ms is not None)
        self.shares = self.fair.allowances(budget, self._demands())
        self.used: Counter[str] = Counter()
        self.scheduled: dict[int, ScheduledChunk] = {}
        self.refused: set[int] = set()  # ids of sequences the cache refused in this step
        self.over_share: list[Sequence] = []
        self.tokens = self.pairs = 0
        self.admitted = False  # a waiting sequence was admitted in the step
        # Under a time cap, the least-served tenant with a prompt to compute (of those equally
        # served, one the cap is not for) gets at least `MIN_CAPPED_PREFILL_TOKENS` of it.
        prompts = [s for s in scheduler.running if not _decodes(s)] + list(scheduler.waiting)
        tenants = {sequence.request.tenant_id for sequence in prompts}
        self.floor_tenant = min(
            tenants, key=lambda t: (self.fair.counter(t), t in scheduler.light), default=None
        )
        self.floor_given = False

    def _demands(self) -> dict[str, int]:
        """What each tenant could use of this step (waiting prompts counted uncached)."""
        demands: Counter[str] = Counter()
        for sequence in self.scheduler.running:
            wanted = _chunk_size(sequence, sequence.num_computed, self.per_prefill)
            demands[sequence.request.tenant_id] += wanted
        for sequence in self.scheduler.waiting:
            wanted = _chunk_size(sequence, sequence.num_computed, self.per_prefill)
            tenant = sequence.request.tenant_id
            demands[tenant] = min(self.budget, demands[tenant] + wanted)
        return dict(demands)

    # -- running and waiting sequences -------------------------------------------------------

    def run_decodes(self) -> None:
        """Every running sequence's decode: they always run."""
        running = self.scheduler.running
        for sequence in list(running):
            if self.budget <= 0:
                break
            if _decodes(sequence) and sequence in running:  # not preempted meanwhile
                self._run(sequence, 1)

    def run_prefills(self, waiting: list[Sequence]) -> None:
        """Unfinished prefills and waiting sequences, the least-served tenant's first (a
        tenant's running ones before its waiting ones, in `waiting`'s order), each within its
        tenant's share and the time cap; nothing is admitted after a preemption."""
        running = self.scheduler.running
        order: list[tuple[float, int, int, Sequence]] = [
            (self._turn(sequence), 0, index, sequence)
            for index, sequence in enumerate(running)
            if not _decodes(sequence)
        ]
        order += [
            (self._turn(sequence), 1, index, sequence) for index, sequence in enumerate(waiting)
        ]
        order.sort(key=lambda item: item[:3])
        for _, waits, _, sequence in order:
            if self.budget <= 0 or self._out_of_time():
                break
            if waits:
                if not self.output.preempted:
                    self.admit_waiting([sequence], shares=True)
            elif sequence in running:  # not preempted for an earlier sequence's blocks
                allowed = min(self.budget, self.per_prefill, self._left(sequence))
                allowed = self._within_time(sequence, sequence.num_computed, allowed)
                if allowed > 0:
                    count = _chunk_size(sequence, sequence.num_computed, allowed)
                    # Blocks a sequence admitted in this step took are not won back by
                    # preempting an older one: the prefill waits a step instead.
                    self._run(sequence, count, preempt=not self.admitted)

    def _turn(self, sequence: Sequence) -> float:
        """Where a prefill comes in the step: by its tenant's counter, and in a capped step a
        short prompt as if its tenant were `slack` less served (the cap is there for it; a
        tenant more than that ahead waits its turn)."""
        counter = self.fair.counter(sequence.request.tenant_id)
        if self.cap_ms is not None and self.scheduler.is_short(sequence):
            counter -= self.fair.slack
        return counter

    def _run(self, sequence: Sequence, count: int, preempt: bool = True) -> None:
        if not preempt:
            if self.scheduler.manager.allocate(sequence.request_id, sequence.num_computed + count):
                self.refused.add(id(sequence))
            else:
                self._add(sequence, count)
            return
        grown, preempted = self.scheduler._grow(sequence, count, set(self.scheduled))
        self.refused.update(id(victim) for victim in preempted)
        self.output.preempted += len(preempted)
        if grown:
            self._add(sequence, count)

    def _out_of_time(self) -> bool:
        """Whether the time cap leaves no room for another prefill token in this step (and the
        least-served tenant had its floor)."""
        if self.cap_ms is None or (self.floor_tenant is not None and not self.floor_given):
            return False
        return self._within_time(None, 0, 1) == 0

    def admit_waiting(self, candidates: list[Sequence], shares: bool) -> None:
        """Admit `candidates` in order, each within its tenant's share (with `shares`) or any
        size; those whose tenant's share is spent go to `over_share`, to be tried again with
        leftovers."""
        scheduler = self.scheduler
        for sequence in candidates:
            if self.budget <= 0 or len(scheduler.running) >= scheduler.config.max_num_seqs:
                break
            if self._out_of_time():
                break
            allowed = min(self.budget, self.per_prefill)
            if shares:
                allowed = min(allowed, self._left(sequence))
            if allowed <= 0:
                self.over_share.append(sequence)
                continue

            def limit(start: int, sequence: Sequence = sequence, allowed: int = allowed) -> int:
                return self._within_time(sequence, start, _chunk_size(sequence, start, allowed))

            count, refused = scheduler._admit(sequence, limit, self.output)
            if refused:
                self.refused.add(id(sequence))
            if count:
                self.admitted = True
                self._add(sequence, count)

    # -- leftovers ----------------------------------------------------------------------------

    def give_leftovers(self) -> None:
        """Give the budget no tenant used within its share to running prefills that their
        tenant's share cut short or left out, least-served tenant's first, within the time cap,
        where the cache has the blocks now (no preemption for leftovers)."""
        running = sorted(
            self.scheduler.running, key=lambda s: self.fair.counter(s.request.tenant_id)
        )
        for sequence in running:
            if self.budget <= 0 or self._out_of_time():
                break
            chunk = self.scheduled.get(id(sequence))
            have = chunk.num_tokens if chunk else 0
            start = sequence.num_computed + have
            wanted = _chunk_size(
                sequence, sequence.num_computed, min(self.per_prefill, have + self.budget)
            )
            extra = self._within_time(None, start, wanted - have)
            if extra <= 0:
                continue
            if self.scheduler.manager.allocate(sequence.request_id, start + extra):
                continue  # refused: the blocks are not there without preempting someone
            if chunk is None:
                self._add(sequence, extra)
            else:
                self._extend(chunk, extra)

    # -- bookkeeping --------------------------------------------------------------------------

    def _left(self, sequence: Sequence) -> int:
        tenant = sequence.request.tenant_id
        return self.shares.get(tenant, 0) - self.used[tenant]

    def _within_time(self, sequence: Sequence | None, start: int, tokens: int) -> int:
        """How many of `tokens` from position `start` the time cap lets in (all without a cap);
        the least-served tenant's first prefill (`sequence`'s, if it is) gets the floor."""
        if self.cap_ms is None or self.cost is None or tokens <= 0:
            return tokens
        left = self.cap_ms - self.cost.predict_ms(self.tokens, self.pairs, self.threads)
        fitting = self.cost.fitting_tokens(left, start, self.threads, tokens)
        floored = sequence is not None and sequence.request.tenant_id == self.floor_tenant
        if floored and not self.floor_given:
            fitting = max(fitting, min(tokens, MIN_CAPPED_PREFILL_TOKENS))
        return fitting

    def _add(self, sequence: Sequence, count: int) -> None:
        chunk = ScheduledChunk(sequence, 0)
        self.output.chunks.append(chunk)
        self.scheduled[id(sequence)] = chunk
        self._extend(chunk, count)

    def _extend(self, chunk: ScheduledChunk, count: int) -> None:
        sequence = chunk.sequence
        start = sequence.num_computed + chunk.num_tokens
        chunk.num_tokens += count
        self.used[sequence.request.tenant_id] += count
        self.budget -= count
        self.tokens += count
        self.pairs += attended_pairs(start, count)
        if not _decodes(sequence) and sequence.request.tenant_id == self.floor_tenant:
            self.floor_given = True

    def held_back(self) -> set[str]:
        """Tenants this step left wanting for lack of budget, share or time (not for lack of
        blocks or seats: the cache refusing a tenant is its quota or the pool, and sequences
        wait for a seat in the order they came, not by service)."""
        held: set[str] = set()
        for sequence in self.scheduler.running:
            chunk = self.scheduled.get(id(sequence))
            got = chunk.num_tokens if chunk else 0
            wanted = _chunk_size(sequence, sequence.num_computed, self.per_prefill)
            if got < wanted and id(sequence) not in self.refused:
                held.add(sequence.request.tenant_id)
        seats = len(self.scheduler.running) < self.scheduler.config.max_num_seqs
        for sequence in self.scheduler.waiting:
            if seats and id(sequence) not in self.refused:
                held.add(sequence.request.tenant_id)
        return held

    def finish(self) -> SchedulerOutput:
        """Charge each chunk's service to its tenant and predict the step's time."""
        for chunk in self.output.chunks:
            sequence = chunk.sequence
            units = self.scheduler.service_cost or self.cost
            if units is not None:
                chunk.service = units.service(sequence.num_computed, chunk.num_tokens)
            else:
                chunk.service = float(chunk.num_tokens)
            chunk.decode = _decodes(sequence)
            self.fair.charge(sequence.request.tenant_id, chunk.service)
        self.output.pairs = self.pairs
        if self.cost is not None and self.output.chunks:
            self.output.predicted_ms = self.cost.predict_ms(self.tokens, self.pairs, self.threads)
        self.fair.end_step(self.held_back())
        return self.output


def _decodes(sequence: Sequence) -> bool:
    """Whether the sequence's next token is a decode (its prompt is computed)."""
    return sequence.num_tokens - sequence.num_computed == 1 and (
        sequence.num_computed >= sequence.prompt_len
    )


def _fair_order(
    waiting: deque[Sequence], running: list[Sequence], fair: FairShare
) -> list[Sequence]:
    """Waiting sequences, the least-served tenants first; among equally served tenants, those
    with the fewest sequences running first and in turns (each tenant's k-th waiting sequence
    counts as its running + k-th); each tenant's in arrival order."""
    load = Counter(sequence.request.tenant_id for sequence in running)
    keys = {}
    for position, sequence in enumerate(waiting):
        tenant = sequence.request.tenant_id
        keys[id(sequence)] = (fair.counter(tenant), load[tenant], position)
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
    # Never the owner's id: it is internal, and the caller names the tenant its own way.
    public = not isinstance(refusal, PoolExhausted) and refusal.owner is PUBLIC_OWNER
    if isinstance(refusal, QuotaExceeded):
        budget = "public cache budget" if public else "tenant's cache quota"
        return CacheQuotaTimeout(
            f"the {budget} stayed full {waited}: {refusal.active_blocks} of its "
            f"{refusal.quota_blocks} blocks are in use and {refusal.needed_blocks} more are needed"
        )
    if isinstance(refusal, ShareExceeded):
        # The tenant's own limit (429), not a crowded pool (503): see `Quotas.plan`.
        whose = "the public cache budget's" if public else "the tenant's"
        return CacheQuotaTimeout(
            f"{whose} share of the KV cache stayed full {waited}: {refusal.active_blocks} of "
            f"the {refusal.share_blocks} blocks other tenants' reservations leave it are in "
            f"use and {refusal.needed_blocks} more are needed"
        )
    return PoolTimeout(f"{refusal} {waited}")
