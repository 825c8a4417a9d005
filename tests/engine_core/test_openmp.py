"""engine/openmp.py: the OpenMP default the engine sets and what another program's process
inherits from it (a fresh interpreter each: the default acts once, at `import engine`), and
`ThreadGovernor`'s rule for computing with fewer threads, on a clock the test moves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.openmp import SPIN_COUNT, ThreadGovernor

PROBE = (
    "import os, engine\n"
    "from engine.openmp import foreign_environment, threads_spin\n"
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


class Machine:
    """A wall clock and an engine-thread CPU clock the test advances, and the thread counts
    the governor set."""

    def __init__(self) -> None:
        self.wall = self.cpu = 100.0
        self.set: list[int] = []

    def governor(self, threads: int = 4) -> ThreadGovernor:
        return ThreadGovernor(
            threads,
            clock=lambda: self.wall,
            cpu_clock=lambda: self.cpu,
            set_threads=self.set.append,
        )

    def step(
        self, governor: ThreadGovernor, seconds: float, on_cpu: float, tokens: int = 16
    ) -> int:
        """One step of `seconds` with the engine thread on its CPU for `on_cpu` of it; the
        threads it ran with."""
        with governor.step(tokens):
            threads = governor.threads
            self.wall += seconds
            self.cpu += seconds * on_cpu
        return threads


def test_all_threads_while_the_engine_thread_keeps_its_cpu() -> None:
    machine = Machine()
    governor = machine.governor()
    for _ in range(10):
        assert machine.step(governor, 0.02, on_cpu=0.95) == 4
    assert (governor.threads, governor.narrowed, machine.set) == (4, 0, [])


def test_a_step_off_cpu_narrows_to_the_share_it_had_then_retries_after_a_while() -> None:
    machine = Machine()
    governor = machine.governor()
    machine.step(governor, 0.02, on_cpu=0.5)
    assert (governor.threads, governor.narrowed, machine.set) == (2, 1, [2])
    # Narrowed steps are not judged, and no try comes before FIRST_RETRY_S.
    assert machine.step(governor, 0.2, on_cpu=0.1) == 2
    assert machine.step(governor, 0.2, on_cpu=1.0) == 2
    machine.wall += ThreadGovernor.FIRST_RETRY_S + 0.1
    assert machine.step(governor, 0.02, on_cpu=0.9) == 4  # the try, unhindered: kept
    assert (governor.threads, governor.narrowed, machine.set) == (4, 1, [2, 4])


def test_failed_tries_wait_twice_as_long_each_time_up_to_the_last_retry() -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    machine.step(governor, 0.02, on_cpu=0.5)
    waits, wait = [], ThreadGovernor.FIRST_RETRY_S
    for _ in range(6):
        # Just before the retry time nothing is tried; at it, the try fails again.
        machine.wall += wait - 0.1
        assert machine.step(governor, 0.05, on_cpu=0.5) == 1
        machine.wall += 0.1
        assert machine.step(governor, 0.02, on_cpu=0.5) == 2
        assert governor.threads == 1
        waits.append(wait)
        wait = min(ThreadGovernor.LAST_RETRY_S, wait * 2)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert governor.narrowed == 1  # a failed try is not a new narrowing
    # A successful try starts the waits over.
    machine.wall += ThreadGovernor.LAST_RETRY_S + 0.1
    assert machine.step(governor, 0.02, on_cpu=1.0) == 2
    machine.step(governor, 0.02, on_cpu=0.4)
    machine.wall += ThreadGovernor.FIRST_RETRY_S + 0.1
    assert machine.step(governor, 0.02, on_cpu=1.0) == 2
    assert governor.narrowed == 2


def test_only_small_steps_try_all_threads_again_and_short_steps_are_not_judged() -> None:
    machine = Machine()
    governor = machine.governor(threads=2)
    machine.step(governor, 0.004, on_cpu=0.1)  # under MIN_STEP_S: says nothing
    assert governor.threads == 2
    machine.step(governor, 0.02, on_cpu=0.3)
    assert governor.threads == 1
    machine.wall += 60
    big = ThreadGovernor.TRY_MAX_TOKENS + 1
    assert machine.step(governor, 0.5, on_cpu=1.0, tokens=big) == 1
    assert machine.step(governor, 0.02, on_cpu=1.0, tokens=ThreadGovernor.TRY_MAX_TOKENS) == 2
    assert governor.threads == 2


def test_narrowing_keeps_at_least_one_thread_and_gives_up_at_least_one() -> None:
    machine = Machine()
    few = machine.governor(threads=2)
    machine.step(few, 0.02, on_cpu=0.05)
    many = machine.governor(threads=16)
    machine.step(many, 0.02, on_cpu=0.79)
    barely = machine.governor(threads=2)
    machine.step(barely, 0.02, on_cpu=0.79)  # round(2 * 0.79) is 2: one is given up anyway
    assert (few.threads, many.threads, barely.threads) == (1, 13, 1)
