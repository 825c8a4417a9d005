"""`bench.choices` on a tiny model: n choices compute the prompt once and hold it once."""

from __future__ import annotations

from bench.choices import main


def test_n_choices_cost_one_prompt_where_separate_requests_cost_n() -> None:
    result = main(["--tiny", "--n", "4", "--prompt-tokens", "200", "--output-tokens", "4"])
    shared = result["one_request_n_choices"]
    separate = result["separate_requests_no_cache"]
    single = result["one_request_n_1"]
    assert shared["choices"] == separate["choices"] == 4
    assert shared["prompt_positions_computed"] == single["prompt_positions_computed"] == 200
    assert separate["prompt_positions_computed"] == 4 * 200
    # 12 full prompt blocks held once, then each choice's own copy of the partial block (and
    # the block its output reaches) -- against 13 blocks per separate request.
    assert shared["peak_blocks"] <= 12 + 4 * 2 < separate["peak_blocks"]
    assert shared["completion_tokens"] == 4 * 4
