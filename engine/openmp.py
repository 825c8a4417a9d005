"""How the engine uses torch's OpenMP threads on the CPU.

Two measured rules (2-core machine, SmolLM2-135M in bf16):
- Idle OpenMP threads must sleep, not spin: libgomp's default busy-waiting takes the CPU from
  everything else (the gateway's event loop, another process); with a second busy process a
  decode step took 0.1-1.2 s with spinning threads and 38 ms with sleeping ones. `defaults()`
  sets `OMP_WAIT_POLICY=PASSIVE` unless the environment says otherwise; it must run before
  torch is first imported, so `engine/__init__.py` calls it. `foreign_environment()` is the
  environment without it, for a process of another program (bench.peers' vLLM), which should
  wait as its own defaults say.
- One thread should do the engine's parallel torch work. libgomp keeps a pool of workers per
  thread that starts parallel regions, and while a second pool lives (the thread that loaded
  the model, say) every region is slower to start: a decode step took 30 ms instead of 21 ms.
  `on_passing_thread` runs set-up work (loading the model, building the engine) on a thread
  that then ends, taking its pool with it, so the engine thread's pool is the only one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


# The settings `defaults()` put into this process's environment (not those it found there):
# a child process that is not PrefixGate (a benchmark's peer engine) should not inherit them.
SET_BY_DEFAULTS: set[str] = set()


def defaults() -> None:
    """OpenMP settings the engine wants, unless the environment already chose."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        SET_BY_DEFAULTS.add("OMP_WAIT_POLICY")


def foreign_environment() -> dict[str, str]:
    """This process's environment without what `defaults()` added: for another program's
    process, which should run with its own defaults."""
    return {name: value for name, value in os.environ.items() if name not in SET_BY_DEFAULTS}


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
