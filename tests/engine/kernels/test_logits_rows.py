"""The sampler's one-pass argmax and finiteness check (`logits_rows.cpp`) against torch's
`argmax` and `isfinite(...).all()`, row by row."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.logits import argmax_finite
from engine.sampling.sampler import SamplingParams, sample

cpu_build.load()
INF, NAN = float("inf"), float("nan")


def expected(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49_152])
def test_argmax_and_finiteness_match_torch(width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=generator) * 10
    logits[1] = logits[1].round()  # many equal values: the first of them wins
    logits[2, : width // 2] = -INF  # half masked: not finite (unless that half is empty)
    logits[3] = -INF
    logits[4, width - 1] = logits[4].max() + 1  # the greatest at the very end (the tail)
    best, finite = torch.ops.prefixgate.argmax_finite(logits)
    want_best, want_finite = expected(logits)
    assert torch.equal(best, want_best)
    assert torch.equal(finite, want_finite)
    assert finite.tolist() == [True, True, width == 1, False, True]


def test_ties_pick_the_first_index_across_lanes_and_vectors() -> None:
    logits = torch.zeros(3, 64)
    logits[0, [5, 21, 37]] = 7.0  # one lane, three vectors
    logits[1, [40, 9]] = 3.0  # other lanes
    logits[2] = 1.0  # everything equal
    best, _ = torch.ops.prefixgate.argmax_finite(logits)
    assert best.tolist() == [5, 9, 0]
    tail = torch.zeros(2, 17)
    tail[0, [5, 16]] = 2.0  # a vector's lane against the tail after it
    tail[1, 16] = 2.0
    assert torch.ops.prefixgate.argmax_finite(tail)[0].tolist() == [5, 16]


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("column", [0, 31, 40])
def test_any_non_finite_value_marks_its_row_only(bad: float, column: int) -> None:
    logits = torch.randn(3, 41)
    logits[1, column] = bad
    _, finite = torch.ops.prefixgate.argmax_finite(logits)
    assert finite.tolist() == [True, False, True]


def test_rows_with_a_stride_are_read_in_place() -> None:
    wide = torch.randn(4, 80)
    logits = wide[:, 3:70]  # rows contiguous, 80 apart
    best, finite = torch.ops.prefixgate.argmax_finite(logits)
    assert torch.equal(best, logits.argmax(dim=-1)) and bool(finite.all())


@pytest.mark.parametrize(
    "logits",
    [
        torch.zeros(2, 8, dtype=torch.bfloat16),
        torch.zeros(8),
        torch.zeros(2, 0),
        torch.zeros(8, 2).t(),
    ],
    ids=["bf16", "vector", "empty-rows", "strided-columns"],
)
def test_other_layouts_are_refused_by_the_kernel_and_served_by_torch(logits: torch.Tensor) -> None:
    with pytest.raises(RuntimeError):
        torch.ops.prefixgate.argmax_finite(logits)
    if logits.dim() == 2 and logits.shape[1] > 0:
        best, finite = argmax_finite(logits)  # the sampler's entry: torch's ops for these
        assert torch.equal(best, logits.argmax(dim=-1)) and bool(finite.all())


def test_sampler_fails_only_the_non_finite_row_and_argmaxes_the_rest() -> None:
    logits = torch.randn(3, 300)
    logits[1, 7] = NAN
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    tokens = sample(logits.clone(), [greedy] * 3, [None] * 3)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert not isinstance(tokens[1], int)


def test_sampler_argmaxes_after_logit_bias() -> None:
    logits = torch.zeros(2, 100)
    biased = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((42, 5.0),))
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    assert sample(logits, [plain, biased], [None, None]) == [0, 42]


def test_sampler_argmaxes_after_a_grammar_masks_tokens_and_after_penalties() -> None:
    logits = torch.arange(300, dtype=torch.float32).repeat(2, 1)  # 299 is the best
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def constrain(rows: torch.Tensor) -> None:
        rows[0, 250:] = float("-inf")  # row 0 may only take tokens below 250

    assert sample(logits.clone(), [greedy] * 2, [None] * 2, constrain=constrain) == [249, 299]
    penalized = SamplingParams(max_tokens=1, temperature=0.0, frequency_penalty=2.0)
    counts = torch.zeros(300)
    counts[299] = counts[298] = 2  # generated twice before: 4 less each
    assert sample(logits.clone(), [penalized, greedy], [None] * 2, [counts, None]) == [297, 299]
