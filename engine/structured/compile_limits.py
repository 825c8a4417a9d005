"""How much one grammar compile may take: wall time, memory, and processes compiling at once.

A compile runs in a process of its own (`compile_pool.py`): past `timeout_s` that process is
killed, past `memory_mb` of memory its allocations fail, and either way the schema is refused
as the client's. `processes` compiles run at once; a request waits a bounded time for one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """The limits of one grammar compile, and how many run at once."""

    timeout_s: float = 2.0
    memory_mb: int = 1024
    processes: int = 2

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.processes <= 0:
            raise ValueError(f"compile limits must be positive: {self}")
