"""bench.steady_decode: single-stream decode in fresh processes beside the machine's drift."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.steady_decode import judge, main


def process(rate: float, matmul: float, read: float = 20.0) -> dict[str, object]:
    probe = {"matmul_tflops": matmul, "memory_gb_s": 30.0, "read_gb_s": read}
    return {"decode_tok_s": rate, "probes": [probe, probe]}


def test_an_engine_at_two_speeds_on_a_steady_machine_is_not_steady() -> None:
    verdict = judge([process(50.0, 1.0), process(25.0, 1.05), process(48.0, 1.0)], 1.25)
    assert verdict["engine_spread"] == pytest.approx(2.0)
    assert verdict["machine_spread"]["matmul"] == pytest.approx(1.05)
    assert verdict["steady"] is False and verdict["slowest_process"] == 1


def test_an_engine_that_moves_with_the_machine_is_steady() -> None:
    # The machine's reads slowed 1.6x in the second process's minutes, and the engine 1.5x.
    verdict = judge([process(45.0, 1.0, 32.0), process(30.0, 1.0, 20.0)], 1.25)
    assert verdict["machine_spread"]["read"] == pytest.approx(1.6)
    assert verdict["steady"] is True


def test_a_tiny_run_measures_each_fresh_process(tmp_path: Path) -> None:
    out = tmp_path / "steady.json"
    result = main(
        ["--tiny", "--processes", "2", "--steps", "12", "--prefix-tokens", "32",
         "--unique-tokens", "16", "--out", str(out)]
    )  # fmt: skip
    assert out.exists() and result["workload"]["processes"] == 2
    assert [process["process"] for process in result["processes"]] == [0, 1]
    for measured in result["processes"]:
        assert measured["decode_tok_s"] > 0
        assert 0 < measured["gap_ms"]["p50"] <= measured["gap_ms"]["p90"]
        assert len(measured["probes"]) == 2
        assert measured["warm_up_s"] > 0  # each process's engine warmed up before it decoded
    rates = [measured["decode_tok_s"] for measured in result["processes"]]
    assert result["engine_spread"] == pytest.approx(max(rates) / min(rates))
    assert isinstance(result["steady"], bool)
    assert "cpu_model" in result["machine"]
