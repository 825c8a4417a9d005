"""Engine counters and timings, written by the engine thread, read by anyone."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from engine.request import Usage

_WINDOW = 4096


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

    def record_step(
        self, seconds: float, tokens: int, preempted: int, waiting: int, running: int
    ) -> None:
        self.steps += 1
        self.step_seconds_total += seconds
        self.step_seconds.append(seconds)
        self.scheduled_tokens += tokens
        self.preemptions += preempted
        self.waiting, self.running = waiting, running

    def record_ttft(self, seconds: float) -> None:
        self.ttft_seconds.append(seconds)

    def record_finish(self, usage: Usage) -> None:
        self.finished += 1
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens
        self.completion_tokens += usage.completion_tokens

    def median_ttft(self) -> float:
        return statistics.median(self.ttft_seconds) if self.ttft_seconds else 0.0
