"""`bench.decode_step` on a tiny model: step times at 1 and N streams, and a step's shares."""

from __future__ import annotations

import pytest

from bench.decode_step import main, share_of


def test_a_step_splits_into_attention_linear_layers_and_the_rest() -> None:
    # 8 x 512 own tokens take two steps' budgets to prefill, so the first four streams decode
    # a step before the others: each measured step must still be one of all eight (checked).
    arguments = "--tiny --prefix-tokens 64 --unique-tokens 512 --streams 8 --steps 4 --rounds 1"
    result = main([*arguments.split(), "--json"])
    assert result["streams"] == 8 and result["attention_backend"] == "cpu"
    one, eight = result["step_ms"]["1"], result["step_ms"]["8"]
    assert result["scaling"] == pytest.approx(8 * one / eight)
    for count in ("1", "8"):
        shares = result["shares_ms"][count]
        # The kernels' ops are found, and they take less than the whole step.
        assert shares["attention"] > 0 and shares["linear"] > 0
        assert shares["attention"] + shares["linear"] < shares["step"]


@pytest.mark.parametrize(
    "arguments", ["--streams 1", "--steps 0", "--rounds x", "--unique-tokens 0"]
)
def test_a_bad_argument_is_one_line_and_exit_2(
    arguments: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(arguments.split())
    assert exit.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument --" in last_line


def test_ops_are_counted_where_they_belong() -> None:
    assert share_of("prefixgate::paged_attention") == "attention"
    assert share_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert share_of("prefixgate::matrix_linear") == "linear"
    assert share_of("aten::addmm") == "linear"
    assert share_of("aten::bmm") == "linear"
    assert share_of("aten::linear") == "linear"
    assert share_of("prefixgate::add_rms_norm_") == "rest"
    assert share_of("aten::index") == "rest"
