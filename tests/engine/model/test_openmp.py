"""engine/model/openmp.py: the OpenMP default the engine sets and what another program's process
inherits from it (a fresh interpreter each: the default acts once, at `import engine`), and
`ThreadGovernor`'s rule for computing with fewer threads, on clocks the test moves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from engine.model.openmp import SPIN_COUNT, ThreadGovernor, waited_for_cpu

PROBE = (
    "import os, engine\n"
    "from engine.model.openmp import foreign_environment, threads_spin\n"
    "for name in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT'):\n"
    "    print(os.environ.get(name), foreign_environment().get(name))\n"
    "print(threads_spin())\n"
)


def probe(**chosen: str) -> list[str]:
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {name: value for name, value in os.environ.items() if name not in names}
    env.update(chosen)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.split()


SCHEDSTAT = pytest.mark.skipif(
    waited_for_cpu() is None, reason="this kernel does not report a thread's CPU waits"
)


@SCHEDSTAT
def test_idle_threads_spin_briefly_by_default_and_another_program_does_not_inherit_it() -> None:
    assert probe() == ["None", "None", SPIN_COUNT, "None", "True"]


@pytest.mark.parametrize("policy", ["ACTIVE", "PASSIVE"])
def test_a_policy_the_environment_chose_is_kept_and_passed_on(policy: str) -> None:
    spins = str(policy == "ACTIVE")
    assert probe(OMP_WAIT_POLICY=policy) == [policy, policy, "None", "None", spins]


@pytest.mark.parametrize("count", ["0", "500000"])
def test_a_spin_count_the_environment_chose_is_kept_and_passed_on(count: str) -> None:
    spins = str(count != "0")
    assert probe(GOMP_SPINCOUNT=count) == ["None", "None", count, count, spins]
    # libgomp spins for an explicit count even when told PASSIVE.
    both = probe(OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT=count)
    assert both == ["PASSIVE", "PASSIVE", count, count, spins]


@SCHEDSTAT
def test_a_threads_wait_for_a_cpu_is_read_in_seconds() -> None:
    # Where Linux does not report it, threads sleep by default: OMP_WAIT_POLICY=PASSIVE.
    first = waited_for_cpu()
    cpus = len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cpus)]
    try:
        ends = time.monotonic() + 0.5
        while time.monotonic() < ends:  # runnable beside two busy processes a CPU: it waits
            sum(range(1000))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    last = waited_for_cpu()
    assert first is not None and last is not None and 0.01 < last - first < 1.0


class Machine:
    """A wall clock and the engine thread's CPU wait, both moved by the test, and the thread
    counts the governor set."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.waited = 0.0
        self.set: list[int] = []

    def governor(self, threads: int = 4) -> ThreadGovernor:
        return ThreadGovernor(
            threads,
            clock=lambda: self.wall,
            waited=lambda: self.waited,
            set_threads=self.set.append,
        )

    def step(
        self, governor: ThreadGovernor, seconds: float, waiting: float, tokens: int = 16
    ) -> int:
        """One step of `seconds`, `waiting` of it spent waiting for a CPU; the threads it ran
        with."""
        with governor.step(tokens):
            threads = governor.threads
            self.wall += seconds
            self.waited += seconds * waiting
        return threads

    def window(self, governor: ThreadGovernor, waiting: float, tokens: int = 16) -> int:
        """Five 60 ms steps (judged as one window), each `waiting` of it; the threads the
        first ran with."""
        first = self.step(governor, 0.06, waiting, tokens)
        for _ in range(4):
            self.step(governor, 0.06, waiting, tokens)
        return first


WINDOW = 0.3  # Machine.window's wall time: the fifth step completes a window
assert 0.24 < ThreadGovernor.WINDOW_S <= WINDOW


def test_all_threads_while_the_engine_thread_gets_a_cpu_at_once() -> None:
    machine = Machine()
    governor = machine.governor()
    for _ in range(4):
        assert machine.window(governor, waiting=0.15) == 4
    assert (governor.threads, governor.narrowed, machine.set) == (4, 0, [])


def test_a_moments_wait_is_judged_with_its_window_and_does_not_narrow() -> None:
    machine = Machine()
    governor = machine.governor()
    machine.step(governor, 0.02, waiting=0.9)  # a client starting, a scrape
    machine.window(governor, waiting=0.0)
    assert (governor.threads, governor.narrowed) == (4, 0)


def test_a_window_of_waiting_narrows_to_the_share_run_then_all_are_tried_after_a_while() -> None:
    machine = Machine()
    governor = machine.governor()
    machine.window(governor, waiting=0.5)
    assert (governor.threads, governor.narrowed, machine.set) == (2, 1, [2])
    assert machine.window(governor, waiting=0.0) == 2  # narrowed windows that do not wait
    machine.wall += ThreadGovernor.FIRST_RETRY_S + 0.01
    assert machine.window(governor, waiting=0.1) == 4  # the try, a window without waiting
    assert (governor.threads, governor.narrowed, machine.set) == (4, 1, [2, 4])


def test_the_governor_says_when_and_why_it_last_gave_threads_up() -> None:
    machine = Machine()
    governor = machine.governor()
    assert governor.describe() == {
        "threads": 4, "all_threads": 4, "trying_all": False, "narrowings": 0,
        "last_narrowed_at": None, "last_waited_share": 0.0,
    }  # fmt: skip
    before = time.time()
    machine.window(governor, waiting=0.5)
    shown = governor.describe()
    assert (shown["threads"], shown["narrowings"], shown["last_waited_share"]) == (2, 1, 0.5)
    assert isinstance(shown["last_narrowed_at"], float)
    assert before <= shown["last_narrowed_at"] <= time.time()


def test_narrowed_windows_that_still_wait_narrow_further() -> None:
    machine = Machine()
    governor = machine.governor(threads=16)
    machine.window(governor, waiting=0.25)
    assert governor.threads == 12
    machine.window(governor, waiting=0.5)  # before the first try (FIRST_RETRY_S)
    assert (governor.threads, governor.narrowed, machine.set) == (6, 1, [12, 6])


def test_failed_tries_wait_twice_as_long_each_time_up_to_the_last_retry() -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    machine.window(governor, waiting=0.5)
    wait = ThreadGovernor.FIRST_RETRY_S
    for _ in range(6):  # waits of 0.5, 1, 2, 4, 8 and 8 s
        # Just before the retry time nothing is tried; after it, the try's window waits again.
        machine.wall += wait - WINDOW - 0.1
        assert machine.window(governor, waiting=0.0) == 1
        machine.wall += 0.1
        assert machine.window(governor, waiting=0.5) == 2
        assert governor.threads == 1
        wait = min(ThreadGovernor.LAST_RETRY_S, wait * 2)
    assert governor.narrowed == 1  # a failed try is not a new narrowing


def test_a_failed_try_goes_back_to_the_narrower_count() -> None:
    machine = Machine()
    governor = machine.governor(threads=16)
    machine.window(governor, waiting=0.9)
    assert governor.threads == 2
    machine.wall += 1
    assert machine.window(governor, waiting=0.25) == 16  # the try waits: back to 2, not 12
    assert governor.threads == 2


def test_contention_soon_after_widening_does_not_start_the_schedule_over() -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    machine.window(governor, waiting=0.5)
    machine.wall += 0.6
    assert machine.window(governor, waiting=0.0) == 2  # widened
    machine.window(governor, waiting=0.5)  # narrowed again at once: the next wait doubles
    machine.wall += ThreadGovernor.FIRST_RETRY_S + 0.01
    assert machine.window(governor, waiting=0.0) == 1
    machine.wall += 0.5
    assert machine.window(governor, waiting=0.0) == 2
    # Long after the last widening, a narrowing starts over at FIRST_RETRY_S.
    machine.wall += ThreadGovernor.LAST_RETRY_S + 1
    machine.window(governor, waiting=0.5)
    machine.wall += ThreadGovernor.FIRST_RETRY_S + 0.01
    assert machine.window(governor, waiting=0.0) == 2
    assert governor.narrowed == 3


def test_small_steps_start_a_try_and_a_big_one_only_when_the_try_is_long_overdue() -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    machine.window(governor, waiting=0.7)
    machine.wall += 1.0
    big = ThreadGovernor.TRY_MAX_TOKENS + 1
    assert machine.step(governor, 0.5, waiting=0.0, tokens=big) == 1
    assert machine.window(governor, waiting=0.0, tokens=ThreadGovernor.TRY_MAX_TOKENS) == 2
    machine.window(governor, waiting=0.7)
    machine.wall += 2 * ThreadGovernor.LAST_RETRY_S  # past any retry time, by LAST_RETRY_S
    assert machine.step(governor, 0.5, waiting=0.0, tokens=big) == 2


def test_a_step_that_raises_is_measured_too() -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    with pytest.raises(RuntimeError), governor.step(16):
        machine.wall += WINDOW
        machine.waited += WINDOW * 0.75
        raise RuntimeError("the model failed")
    assert governor.threads == 1


def test_narrowing_keeps_at_least_one_thread_and_gives_up_at_least_one() -> None:
    machine = Machine()
    few = machine.governor(threads=2)
    machine.window(few, waiting=0.95)
    barely = machine.governor(threads=2)
    machine.window(barely, waiting=0.21)  # round(2 * 0.79) is 2: one is given up anyway
    assert (few.threads, barely.threads) == (1, 1)


def test_a_narrowing_is_logged_as_a_warning_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    with caplog.at_level("INFO", logger="engine.model.openmp"):
        for _ in range(3):  # narrow, widen: three times within a minute
            machine.window(governor, waiting=0.5)
            machine.wall += ThreadGovernor.LAST_RETRY_S + 1
            machine.window(governor, waiting=0.0)
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert governor.narrowed == 3 and len(warnings) == 1
    assert "computing with 1 of 2 threads" in warnings[0].getMessage()
    widened = [record for record in caplog.records if "free again" in record.getMessage()]
    assert len(widened) == 3


def test_restore_gives_back_all_threads() -> None:
    machine = Machine()
    governor = machine.governor()
    machine.window(governor, waiting=0.5)
    governor.restore()
    assert (governor.threads, machine.set) == (4, [2, 4])
