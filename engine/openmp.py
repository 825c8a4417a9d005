"""How the engine uses torch's OpenMP threads on the CPU.

Three measured rules (2-core machine, SmolLM2-135M in bf16, 1,536-token contexts):
- Idle OpenMP threads spin briefly before they sleep. A decode step runs about 250 parallel
  regions (eight a layer), and a sleeping thread must be woken for each: with sleeping threads
  (`OMP_WAIT_POLICY=PASSIVE`) one stream decoded 26 tok/s and sixteen 242; with threads that
  spin 30,000 pause loops (`GOMP_SPINCOUNT=30000`, about 0.3 ms) 46 and 347. `defaults()` sets
  that spin count unless the environment already chose how threads wait; it must run before
  torch is first imported, so `engine/__init__.py` calls it. `foreign_environment()` is the
  environment without it, for a process of another program (bench.peers' vLLM), which should
  wait as its own defaults say.
- Spinning threads must not share their CPUs. Beside one other busy process the same spinning
  threads decoded 7 tok/s (each waits at every region's end for a thread the kernel has
  descheduled); sleeping threads 27, and one thread alone 25-29. `ThreadGovernor` therefore
  watches each step: when the engine thread was off its CPU for more than a fifth of a step,
  something else wants the CPUs, and the engine computes with fewer threads until a later
  step, tried with all of them again, runs unhindered.
- One thread should do the engine's parallel torch work. libgomp keeps a pool of workers per
  thread that starts parallel regions, and while a second pool lives (the thread that loaded
  the model, say) every region is slower to start: a decode step took 30 ms instead of 21 ms.
  `on_passing_thread` runs set-up work (loading the model, building the engine) on a thread
  that then ends, taking its pool with it, so the engine thread's pool is the only one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch is imported only after `defaults()` has run
    import torch

T = TypeVar("T")

logger = logging.getLogger(__name__)

SPIN_COUNT = "30000"  # pause loops an idle thread spins before it sleeps: about 0.3 ms

# The settings `defaults()` put into this process's environment (not those it found there):
# a child process that is not PrefixGate (a benchmark's peer engine) should not inherit them.
SET_BY_DEFAULTS: set[str] = set()


def defaults() -> None:
    """OpenMP settings the engine wants, unless the environment already chose."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        SET_BY_DEFAULTS.add("GOMP_SPINCOUNT")


def foreign_environment() -> dict[str, str]:
    """This process's environment without what `defaults()` added: for another program's
    process, which should run with its own defaults."""
    return {name: value for name, value in os.environ.items() if name not in SET_BY_DEFAULTS}


def threads_spin() -> bool:
    """Whether idle OpenMP threads busy-wait here (libgomp spins unless told not to)."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    return not passive and os.environ.get("GOMP_SPINCOUNT", "").strip() != "0"


class ThreadGovernor:
    """How many OpenMP threads the engine's steps compute with: all of them while the CPUs are
    the engine's, fewer while something else wants them.

    Each step is timed on the engine thread (the thread that starts every parallel region):
    when it was on its CPU for less than `ON_CPU_SHARE` of a step's wall time, another thread
    took its CPU, and spinning threads would keep waiting for each other. The engine then
    computes with that share of its threads (at least one), and tries all of them again on a
    small step after `FIRST_RETRY_S`, then after twice as long each time the try finds the
    CPUs still busy, up to `LAST_RETRY_S`. Call `step()` on the engine thread only: the
    thread count it sets is that thread's.
    """

    ON_CPU_SHARE = 0.8
    MIN_STEP_S = 0.005  # a shorter step says too little: one preemption decides its share
    TRY_MAX_TOKENS = 64  # tries run on decode-sized steps, which cost little when they fail
    FIRST_RETRY_S = 0.5
    LAST_RETRY_S = 8.0

    def __init__(
        self,
        threads: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.thread_time,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        import torch

        self.all_threads = self.threads = threads
        self.narrowed = 0  # times the engine gave up threads
        self._clock, self._cpu_clock = clock, cpu_clock
        self._set_threads = set_threads or torch.set_num_threads
        self._retry_s = self.FIRST_RETRY_S
        self._retry_at = 0.0

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor where the engine's threads spin on this device's CPUs, else None."""
        import torch

        threads = torch.get_num_threads()
        if device.type != "cpu" or threads < 2 or not threads_spin():
            return None
        return cls(threads)

    @contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Time the step run inside; `tokens` is its size (tries run only on small ones)."""
        trying = (
            self.threads < self.all_threads
            and tokens <= self.TRY_MAX_TOKENS
            and self._clock() >= self._retry_at
        )
        if trying:
            self._use(self.all_threads)
        started, cpu_started = self._clock(), self._cpu_clock()
        yield
        wall = self._clock() - started
        if (self.threads < self.all_threads and not trying) or wall < self.MIN_STEP_S:
            return
        share = (self._cpu_clock() - cpu_started) / wall
        if share >= self.ON_CPU_SHARE:
            if trying:
                logger.info(
                    "engine: the CPUs are free again; computing with %d threads", self.threads
                )
                self._retry_s = self.FIRST_RETRY_S
            return
        self._retry_s = min(self.LAST_RETRY_S, self._retry_s * 2) if trying else self.FIRST_RETRY_S
        self._retry_at = self._clock() + self._retry_s
        fewer = max(1, min(self.all_threads - 1, round(self.all_threads * share)))
        if not trying:
            self.narrowed += 1
            logger.info(
                "engine: its thread was on CPU for %.0f%% of a step; computing with %d of %d "
                "threads while the CPUs are busy",
                share * 100,
                fewer,
                self.all_threads,
            )
        self._use(fewer)

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads


def on_passing_thread(work: Callable[[], T]) -> T:
    """Run `work` on a new thread that ends when it returns; its result or exception."""
    outcome: dict[str, T] = {}
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # re-raised on the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name="prefixgate-setup")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome["value"]
