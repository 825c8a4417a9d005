"""bench/machine_speed.py: the probe's rates follow from the work it times."""

from __future__ import annotations

import pytest
import torch

from bench import machine_speed
from bench.machine_speed import Prober, Speed, summary


def test_the_probe_times_its_product_and_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy 4x the size takes about 4x as long, so the same machine reads about the same
    # rate: the rates are work over time, not time alone. Small sizes keep this quick.
    monkeypatch.setattr(machine_speed, "MATMUL_BUDGET_S", 0.05)
    rates = {}
    for scale in (1, 4):
        monkeypatch.setattr(machine_speed, "MATMUL_SHAPE", (64 * scale, 64, 64))
        monkeypatch.setattr(machine_speed, "COPY_BYTES", (8 << 20) * scale)
        prober = Prober(torch.float32)
        assert prober.describe() == f"{64 * scale}x64x64 float32"
        rates[scale] = prober.probe()
    for speed in rates.values():
        assert speed.matmul_tflops > 0 and speed.copy_gb_s > 0
    # Not equal (a shared CPU), but a rate that ignored the bytes would be off by 4x.
    assert 0.5 < rates[4].copy_gb_s / rates[1].copy_gb_s < 2


def test_summary_gives_least_median_and_most_of_each_rate() -> None:
    speeds = [Speed(2.0, 20.0), Speed(1.0, 25.0), Speed(3.0, 10.0)]
    assert summary(speeds) == {"matmul_tflops": [1.0, 2.0, 3.0], "copy_gb_s": [10.0, 20.0, 25.0]}
