"""The engine computes with fewer CPU threads while other processes take its CPUs, and with
all of them again once they stop (engine/model/openmp.py `ThreadGovernor`): the real embedded model,
real busy processes, the engine thread's real wait for a CPU as Linux reports it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel
from engine.model.openmp import ThreadGovernor
from tests.support.models import Collector, make_request

pytestmark = pytest.mark.slow

BUSY = "while True: pass"


@pytest.fixture
def engine(smollm2: LoadedModel) -> Iterator[Engine]:
    engine = Engine(smollm2, EngineConfig(num_blocks=512))
    if engine.threads is None:
        assert torch.get_num_threads() < 2, "threads spin here (tests/conftest.py): governed"
        pytest.skip("one CPU thread: nothing to govern")
    try:
        yield engine
    finally:
        engine.threads.restore()  # the governor sets this (the test's) thread's count


def decode_steps(
    engine: Engine, tag: str, seconds: float, until: Callable[[], bool] = lambda: False
) -> list[int]:
    """Decode one long request for about `seconds`, or until `until()` holds after a step;
    the thread count after each step."""
    request = make_request(tag, list(range(1000, 1400)), max_tokens=2000)
    engine.submit(request, Collector())
    counts: list[int] = []
    ends = time.monotonic() + seconds
    while time.monotonic() < ends and not (counts and until()):
        engine.step()
        assert engine.threads is not None
        counts.append(engine.threads.threads)
    engine.cancel(tag)
    while engine.step():
        pass
    return counts


def test_busy_processes_narrow_the_engine_and_it_widens_again_once_they_stop(
    engine: Engine,
) -> None:
    governor = engine.threads
    assert governor is not None
    alone = decode_steps(engine, "alone", 1.0)
    # Alone, the steps get their CPUs: whole windows of them never wait a fifth of the time.
    assert set(alone) == {governor.all_threads} and governor.narrowed == 0
    # As many busy processes as the engine has threads: its thread gets about half a CPU.
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(governor.all_threads)]
    try:
        crowded = decode_steps(engine, "crowded", 2.0)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert governor.narrowed >= 1
    # /readyz shows when and why (engine.describe()["cpu_threads"]).
    shown = engine.describe()["cpu_threads"]
    assert shown["narrowings"] == governor.narrowed
    assert shown["last_waited_share"] > ThreadGovernor.WAITED_SHARE
    assert time.time() - 10 < shown["last_narrowed_at"] <= time.time()
    # Mostly narrowed: a try may pass by chance, but most steps run with fewer threads.
    assert sum(count < governor.all_threads for count in crowded) > len(crowded) / 2

    # The next try comes at most LAST_RETRY_S after the last failed one; decode until a try
    # has been judged with all threads (a try's first step runs with all of them, unjudged).
    def widened() -> bool:
        return governor.threads == governor.all_threads and not governor.trying

    decode_steps(engine, "freed", ThreadGovernor.LAST_RETRY_S + 2, widened)
    assert widened()
