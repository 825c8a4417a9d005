"""How `bench.peers` gives its engines turns: all start, then each phase runs on every engine
in turn, the order rotated by one engine per phase, with the CPUs left to go idle between two
turns. A peer that fails drops out (reported by name); the reference engine's failure ends the
bench; every engine started is closed at the end. A caller's `before_phase` runs before each
phase's turns (bench.peers probes the machine's speed there). See bench/peers.py for why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import httpx
from tqdm import tqdm

from bench.peer_runners import EngineRun, Phase, Runner, Workload

# How a peer fails: its process exits, its server answers with an error, its stream breaks.
PEER_ERRORS = (subprocess.CalledProcessError, OSError, ValueError, RuntimeError, httpx.HTTPError)
SETTLE_WINDOW_S = 0.25  # between two engines' turns: this long with the CPUs idle


def settle(idle: float = 0.9, limit_s: float = 10.0) -> tuple[float, bool]:
    """Wait until this process's CPUs were `idle` (a fraction) over a whole SETTLE_WINDOW_S, or
    `limit_s` has passed; the seconds waited and whether they settled. An engine can go on
    working after its last token (its threads spinning down, its bookkeeping), and whichever
    engine ran next would pay for it."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        before = cpu_times()
        time.sleep(SETTLE_WINDOW_S)
        after = cpu_times()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total <= 1 - idle:
            return time.monotonic() - started, True
    return time.monotonic() - started, False


def cpu_times() -> tuple[int, int]:
    """The busy and total clock ticks so far of the CPUs this process may run on (/proc/stat's
    per-CPU lines). Busy: user, nice, system, irq, softirq; with idle and iowait, the total.
    Steal (time the hypervisor gave another guest) is neither: it is not this machine's work."""
    mine = {f"cpu{cpu}" for cpu in os.sched_getaffinity(0)}
    busy = total = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if name in mine:
                user, nice, system, idle, iowait, irq, softirq = map(int, fields[:7])
                busy += user + nice + system + irq + softirq
                total += user + nice + system + idle + iowait + irq + softirq
    return busy, total


def interleave(
    workload: Workload,
    reference: Runner,
    peers: Sequence[Runner],
    before_phase: Callable[[Phase], None] = lambda phase: None,
) -> tuple[list[EngineRun], dict[str, str]]:
    """Start every engine, then run each phase on each in turn; the reference's run first.
    A peer that fails is closed and reported by name; the reference's failure is raised.
    Every engine started is closed at the end, whatever fails."""
    failed: dict[str, str] = {}
    running = [reference]

    def attempt(runner: Runner, action: str, step: Callable[[], None]) -> None:
        try:
            step()
        except PEER_ERRORS as error:
            if runner is reference:
                raise
            failed[runner.name] = f"{type(error).__name__}: {error}"
            print(f"{runner.name} failed to {action}; the others go on: {error}", file=sys.stderr)
            running.remove(runner)
            close(runner)

    try:
        reference.start()
        for runner in peers:
            running.append(runner)
            attempt(runner, "start", runner.start)
        settle()
        busy_after = {runner.name: 0.0 for runner in running}
        unsettled = {runner.name: 0 for runner in running}
        for index, phase in enumerate(tqdm(workload.phases, desc="phases", file=sys.stderr)):
            before_phase(phase)  # on idle CPUs: after the start's settle or the last turn's
            settle()  # and none of it left running for the phase's first engine
            turn = index % len(running)
            for runner in running[turn:] + running[:turn]:
                attempt(runner, f"run {phase.name}", partial(runner.run, phase))
                waited, settled = settle()
                busy_after[runner.name] += waited - SETTLE_WINDOW_S
                unsettled[runner.name] += not settled
        runs = [runner.result() for runner in running]
        for runner, run in zip(running, runs, strict=True):
            # How long the machine stayed busy after the engine's phases ended.
            run.notes["busy_after_phases_s"] = round(busy_after[run.name], 2)
            run.notes["phases_not_settled_after"] = unsettled[run.name]
            if runner.narrowed_phases is not None:
                run.notes["narrowed_phases"] = runner.narrowed_phases
        return runs, failed
    finally:
        for runner in running:
            close(runner)


def close(runner: Runner) -> None:
    """`runner.close()`; an error in it is reported, not raised, so the others still close
    and the error that ended the bench, if one did, is the one that shows."""
    try:
        runner.close()
    except Exception as error:  # reported: the others still close
        print(f"{runner.name} did not close cleanly: {error!r}", file=sys.stderr)
