"""Engine counters and timings, written by the engine thread, read by anyone."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.request import Usage

_WINDOW = 4096


@dataclass(frozen=True, slots=True)
class TenantService:
    """One tenant's service from an engine since it started: prompt positions computed (cached
    ones cost nothing), tokens decoded, and their cost in prefill-token units (decodes weighted
    by the measured cost ratio; before dividing by the tenant's weight)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    service: float = 0.0


_NO_SERVICE = TenantService()


@dataclass
class EngineMetrics:
    """Totals since start plus recent TTFT and step-time samples."""

    steps: int = 0
    step_seconds_total: float = 0.0
    scheduled_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    waiting: int = 0
    running: int = 0
    ttft_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    # Per tenant, replaced whole by the engine thread (readers hold a consistent dict):
    # service since start, and sequences waiting or running after the last step.
    service: dict[str, TenantService] = field(default_factory=dict)
    tenant_sequences: dict[str, int] = field(default_factory=dict)

    def record_step(
        self, seconds: float, tokens: int, preempted: int, waiting: int, running: int
    ) -> None:
        self.steps += 1
        self.step_seconds_total += seconds
        self.step_seconds.append(seconds)
        self.scheduled_tokens += tokens
        self.preemptions += preempted
        self.waiting, self.running = waiting, running

    def record_service(self, served: Iterable[tuple[str, int, bool, float]]) -> None:
        """Add a step's chunks, each (tenant, tokens, whether a decode, service), to their
        tenants' service (in a new dict: readers keep the one they hold)."""
        service = dict(self.service)
        for tenant, tokens, decode, cost in served:
            before = service.get(tenant, _NO_SERVICE)
            decoded = tokens if decode else 0
            service[tenant] = TenantService(
                before.prefill_tokens + tokens - decoded,
                before.decode_tokens + decoded,
                before.service + cost,
            )
        self.service = service

    def record_ttft(self, seconds: float) -> None:
        self.ttft_seconds.append(seconds)

    def record_finish(self, usage: Usage) -> None:
        self.finished += 1
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens
        self.completion_tokens += usage.completion_tokens

    def median_ttft(self) -> float:
        return statistics.median(self.ttft_seconds) if self.ttft_seconds else 0.0
