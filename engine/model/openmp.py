"""How the engine uses torch's OpenMP threads on the CPU.

Three rules, each measured (figures: docs/performance.md):
- Idle OpenMP threads spin briefly before they sleep. A decode step runs eight parallel
  regions a layer, and a sleeping thread must be woken for each: threads that spin 30,000
  pause loops (`GOMP_SPINCOUNT=30000`) decode much faster than sleeping ones
  (`OMP_WAIT_POLICY=PASSIVE`). `defaults()` sets that spin count unless the environment
  already chose how threads wait, or this Linux does not report how long a thread waits for a
  CPU (then threads sleep, as governing needs that number); it must run before torch is first
  imported, so `engine/__init__.py` calls it.
  `foreign_environment()` is the environment without it, for a process of another program
  (bench.peers' vLLM), which should wait as its own defaults say.
- Spinning threads must not share their CPUs. Beside one other busy process the same spinning
  threads decode several times slower than sleeping ones or one thread alone (each waits at
  every region's end for a thread the kernel has descheduled). `ThreadGovernor` therefore
  watches the steps: when the engine thread waited for a CPU for more than a fifth of a
  quarter second of steps, something else wants the CPUs, and the engine computes with fewer
  threads until a later try with all of them runs without waiting.
- One thread should do the engine's parallel torch work. libgomp keeps a pool of workers per
  thread that starts parallel regions, and while a second pool lives (the thread that loaded
  the model, say) the process has more OpenMP threads than CPUs: libgomp then lets idle
  threads spin only 100 loops, every region waits for sleeping threads to wake, and so does
  every decode step.
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

SPIN_COUNT = "30000"  # pause loops an idle thread spins before it sleeps
SCHEDSTAT = "/proc/thread-self/schedstat"  # on-CPU ns, runnable-but-waiting ns, timeslices

# The settings `defaults()` put into this process's environment (not those it found there):
# a child process that is not PrefixGate (a benchmark's peer engine) should not inherit them.
SET_BY_DEFAULTS: set[str] = set()

# torch's thread count before any governor changed it: a governor narrows the count of the
# thread it runs on, and torch hands that count to threads started later.
_threads_at_start: list[int] = []


def defaults() -> None:
    """OpenMP settings the engine wants, unless the environment already chose."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if waited_for_cpu() is None:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        SET_BY_DEFAULTS.add("OMP_WAIT_POLICY")
    else:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        SET_BY_DEFAULTS.add("GOMP_SPINCOUNT")


def foreign_environment() -> dict[str, str]:
    """This process's environment without what `defaults()` added: for another program's
    process, which should run with its own defaults."""
    return {name: value for name, value in os.environ.items() if name not in SET_BY_DEFAULTS}


def threads_spin() -> bool:
    """Whether idle OpenMP threads busy-wait here: libgomp spins for GOMP_SPINCOUNT pause
    loops where it is set, else unless told PASSIVE."""
    count = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if count:
        return count != "0"
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"


def waited_for_cpu() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU, or None where
    Linux does not say (no /proc, or a kernel without scheduler statistics)."""
    try:
        with open(SCHEDSTAT, "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class ThreadGovernor:
    """How many OpenMP threads the engine's steps compute with: all of them while the CPUs are
    the engine's, fewer while something else wants them.

    Steps are measured on the engine thread (the thread that starts every parallel region):
    how long the kernel kept it waiting for a CPU, against the steps' wall time, summed over
    a window of at least `WINDOW_S` of steps (so that a moment's work elsewhere, a client
    starting or a scrape, is not taken for contention). Waiting for more than `WAITED_SHARE`
    of a window means other threads want the CPUs, and spinning threads would keep waiting for
    each other: the engine then computes with the share of its threads that the window did not
    wait for (at least one, and at least one fewer), and keeps measuring. After
    `FIRST_RETRY_S` it tries all of them again, starting on a small step (or any step once
    the try is `LAST_RETRY_S` overdue) and judging a whole window; each try that still waits
    doubles the time to the next, up to `LAST_RETRY_S`, and so does a narrowing within
    `LAST_RETRY_S` of the last widening. Waiting for the GIL or at a barrier is not waiting
    for a CPU and does not count. While idle, the count stays as the last step left it. Call
    `step()` on the engine thread only: the thread count it sets is that thread's.
    """

    WAITED_SHARE = 0.2
    WINDOW_S = 0.25  # of steps' wall time, judged together
    TRY_MAX_TOKENS = 64  # tries start on decode-sized steps
    FIRST_RETRY_S = 0.5
    LAST_RETRY_S = 8.0
    WARN_EVERY_S = 60.0  # a narrowing is logged as a warning at most this often

    def __init__(
        self,
        threads: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        waited: Callable[[], float | None] = waited_for_cpu,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        import torch

        self.all_threads = self.threads = threads
        self.narrowed = 0  # times the engine gave up threads it had all of
        # When it last did (wall-clock seconds) and why: the share of the window's steps its
        # thread spent waiting for a CPU. None while it never has.
        self.last_narrowed_at: float | None = None
        self.last_waited_share = 0.0
        self._clock, self._waited = clock, waited
        self._set_threads = set_threads or torch.set_num_threads
        self._retry_s = self.FIRST_RETRY_S
        self._retry_at = 0.0
        self._widened_at = -self.LAST_RETRY_S
        self._warned_at = -self.WARN_EVERY_S
        self._trying = False
        self._narrow = threads  # the count a failed try returns to
        self._window_wall = self._window_waited = 0.0

    @property
    def trying(self) -> bool:
        """Whether all threads are being tried again (the window under way decides)."""
        return self._trying

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """A governor where the engine's threads spin on this device's CPUs and Linux reports
        a thread's wait for a CPU, else None."""
        import torch

        if not _threads_at_start:
            _threads_at_start.append(torch.get_num_threads())
        threads = _threads_at_start[0]
        if device.type != "cpu" or threads < 2 or not threads_spin():
            return None
        if waited_for_cpu() is None:
            logger.warning("engine: threads spin but Linux does not report CPU waits here")
            return None
        if torch.get_num_threads() != threads:  # an earlier engine's narrowing, not undone
            torch.set_num_threads(threads)
        return cls(threads)

    @contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Measure the step run inside; `tokens` is its size (tries start on small ones)."""
        started = self._clock()
        due = not self._trying and self.threads < self.all_threads and started >= self._retry_at
        if due and (tokens <= self.TRY_MAX_TOKENS or started >= self._retry_at + self.LAST_RETRY_S):
            self._trying, self._narrow = True, self.threads
            self._window_wall = self._window_waited = 0.0
            self._use(self.all_threads)
        waited = self._waited()
        try:
            yield
        finally:
            ended, waited_after = self._clock(), self._waited()
            if waited is not None and waited_after is not None:  # else a read failed: skip
                self._window_wall += ended - started
                self._window_waited += waited_after - waited
            if self._window_wall >= self.WINDOW_S:
                self._judge(ended)

    def _judge(self, now: float) -> None:
        share = self._window_waited / self._window_wall
        self._window_wall = self._window_waited = 0.0
        trying, self._trying = self._trying, False
        if share <= self.WAITED_SHARE:
            if trying:
                self._widened_at = now
                logger.info(
                    "engine: the CPUs are free again; computing with %d threads", self.threads
                )
            return
        fewer = max(1, min(self.threads - 1, round(self.threads * (1.0 - share))))
        if trying:
            self._schedule_retry(now, longer=True)
            fewer = min(fewer, self._narrow)
        elif self.threads == self.all_threads:
            self.narrowed += 1
            self.last_narrowed_at, self.last_waited_share = time.time(), share
            self._schedule_retry(now, longer=now - self._widened_at < self.LAST_RETRY_S)
            if now - self._warned_at >= self.WARN_EVERY_S:
                self._warned_at = now
                logger.warning(
                    "engine: its thread waited for a CPU for %.0f%% of its recent steps; "
                    "computing with %d of %d threads while the CPUs are busy (logged at most "
                    "once a minute; prefixgate_engine_cpu_narrowings_total counts them all)",
                    share * 100,
                    fewer,
                    self.all_threads,
                )
        self._use(fewer)

    def describe(self) -> dict[str, object]:
        """The threads steps compute with now, and when and why the engine last gave some up."""
        return {
            "threads": self.threads,
            "all_threads": self.all_threads,
            "trying_all": self._trying,
            "narrowings": self.narrowed,
            "last_narrowed_at": self.last_narrowed_at,
            "last_waited_share": round(self.last_waited_share, 3),
        }

    def _schedule_retry(self, now: float, longer: bool) -> None:
        """The next try: after twice the last wait (up to LAST_RETRY_S), or FIRST_RETRY_S."""
        self._retry_s = min(self.LAST_RETRY_S, self._retry_s * 2) if longer else self.FIRST_RETRY_S
        self._retry_at = now + self._retry_s

    def restore(self) -> None:
        """All threads again, for this thread and the threads torch starts later; a try or a
        window under way is forgotten."""
        self._trying = False
        self._window_wall = self._window_waited = 0.0
        self._use(self.all_threads)

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
