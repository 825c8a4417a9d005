"""`bench.decode_step` on a tiny model: step times at 1 and N streams, and a step's shares."""

from __future__ import annotations

import pytest

from bench.decode_step import main, share_of


def test_a_step_splits_into_attention_linear_layers_and_the_rest() -> None:
    arguments = "--tiny --prefix-tokens 64 --unique-tokens 32 --streams 4 --steps 4 --rounds 1"
    result = main([*arguments.split(), "--json"])
    assert result["streams"] == 4 and result["attention_backend"] in ("cpu", "torch")
    one, four = result["step_ms"]["1"], result["step_ms"]["4"]
    assert one > 0 and four > 0
    assert result["scaling"] == pytest.approx(4 * one / four)
    for count in ("1", "4"):
        shares = result["shares_ms"][count]
        # Self times of the ops inside a step, the rest its wall time less them: each > 0.
        assert shares["attention"] > 0 and shares["linear"] > 0 and shares["rest"] > 0
        assert shares["attention"] + shares["linear"] < shares["step"]


def test_ops_are_counted_where_they_belong() -> None:
    assert share_of("prefixgate::paged_attention") == "attention"
    assert share_of("aten::scaled_dot_product_attention") == "attention"
    assert share_of("prefixgate::matrix_linear") == "linear"
    assert share_of("aten::addmm") == "linear"
    assert share_of("aten::linear") == "linear"
    assert share_of("prefixgate::add_rms_norm_") == "rest"
    assert share_of("aten::index") == "rest"
