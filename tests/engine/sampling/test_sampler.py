"""The sampler: greedy, top-k, top-p, seeds, penalties and logit bias, parameter checks, and
failures kept to their row."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.errors import RequestFailed
from engine.sampling.sampler import (
    MIN_TOP_P,
    InvalidSampling,
    SamplingParams,
    adjust_logits,
    chosen_logprobs,
    make_generator,
    raw_logprobs,
    sample,
)


def logits_batch(seed: int) -> torch.Tensor:
    return torch.randn(3, 50, generator=torch.Generator().manual_seed(seed))


def draw(params: SamplingParams, rows: int = 3, seed_logits: int = 0) -> list[int]:
    logits = logits_batch(seed_logits)[:rows]
    generators = [make_generator(params, torch.device("cpu")) for _ in range(rows)]
    return sample(logits, [params] * rows, generators)


def test_greedy_takes_the_argmax() -> None:
    assert draw(SamplingParams(temperature=0.0)) == logits_batch(0).argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    greedy = logits_batch(0).argmax(-1).tolist()
    assert draw(SamplingParams(temperature=1.0, top_k=1, seed=5)) == greedy
    assert draw(SamplingParams(temperature=1.0, top_p=1e-6, seed=5)) == greedy


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    params = [SamplingParams(temperature=1.5, seed=seed) for seed in range(8)]
    runs = [draw(p) for p in params]
    assert runs == [draw(p) for p in params]
    assert len({tuple(run) for run in runs}) > 1


def test_top_k_never_picks_outside_the_k_best() -> None:
    logits = logits_batch(1)[:1]
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    for seed in range(30):
        params = SamplingParams(temperature=2.0, top_k=5, seed=seed)
        assert sample(logits, [params], [make_generator(params, torch.device("cpu"))])[0] in allowed


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ("",)}, "stop"),
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1e-300}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((3, float("-inf")),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": tuple((token, 1.0) for token in range(1025))}, "logit_bias"),
        ({"logprobs": 21}, "top_logprobs"),
        ({"logprobs": -1}, "top_logprobs"),
    ],
)
def test_invalid_sampling_names_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSampling) as raised:
        SamplingParams(**fields)
    assert raised.value.param == param


@pytest.mark.parametrize("fields", [{"temperature": 0.01}, {"top_p": MIN_TOP_P}])
def test_extreme_valid_sampling_stays_a_distribution(fields: dict[str, Any]) -> None:
    logits = logits_batch(2) * 50  # large logits, as a confident model gives
    params = SamplingParams(**{"temperature": 1.0, "seed": 3, **fields})
    drawn = sample(logits, [params] * 3, [make_generator(params, torch.device("cpu"))] * 3)
    assert drawn == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", [-(2**63), 2**64 - 1])
def test_seeds_at_the_edges_of_the_64_bit_range_are_accepted(seed: int) -> None:
    assert make_generator(SamplingParams(seed=seed), torch.device("cpu")) is not None


def test_non_finite_logits_fail_only_their_row() -> None:
    logits = logits_batch(3)
    logits[1, 7] = float("nan")
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1)
    for params in (greedy, sampled):
        drawn = sample(logits, [params] * 3, [make_generator(params, torch.device("cpu"))] * 3)
        assert isinstance(drawn[1], RequestFailed)
        assert (
            drawn[0]
            == sample(logits[:1], [params], [make_generator(params, torch.device("cpu"))])[0]
        )
        assert isinstance(drawn[2], int)


@pytest.mark.parametrize(("field", "value"), [("temperature", 1e-300), ("top_p", 1e-300)])
def test_degenerate_params_that_skip_validation_fail_only_their_row(
    field: str, value: float
) -> None:
    bad = SamplingParams(temperature=1.0, seed=4)
    object.__setattr__(bad, field, value)  # as if a caller bypassed __post_init__
    good = SamplingParams(temperature=1.0, seed=4)
    logits = logits_batch(4)
    rows = [make_generator(p, torch.device("cpu")) for p in (good, bad, good)]
    drawn = sample(logits, [good, bad, good], rows)
    assert isinstance(drawn[0], int) and isinstance(drawn[2], int)
    if field == "top_p":  # the best token is always kept: greedy, not an empty distribution
        assert drawn[1] == logits[1].argmax().item()
    else:
        assert isinstance(drawn[1], RequestFailed)


def test_penalties_and_bias_follow_openais_definition_row_by_row() -> None:
    logits = logits_batch(4)
    counts = torch.zeros(3, 50)
    counts[0] = torch.bincount(torch.tensor([1, 2, 2, 7, 7, 7]), minlength=50).float()
    counts[2] = torch.bincount(torch.tensor([4, 4, 9]), minlength=50).float()
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25),
        SamplingParams(logit_bias=((3, -100.0), (8, 2.5))),  # no penalties
        SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, logit_bias=((4, 1.0),)),
    ]
    adjusted = logits.clone()
    adjust_logits(adjusted, params, [counts[0], None, counts[2]])
    expected = logits.clone()
    for row in (0, 2):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence, per token j
        for token in range(50):
            c = float(counts[row, token])
            expected[row, token] -= (
                c * params[row].frequency_penalty + (c > 0) * params[row].presence_penalty
            )
    expected[1, 3] -= 100.0
    expected[1, 8] += 2.5
    expected[2, 4] += 1.0
    torch.testing.assert_close(adjusted, expected, atol=1e-6, rtol=0)


def test_bias_decides_greedy_and_excludes_tokens_from_sampling() -> None:
    logits = logits_batch(5)[:1]
    worst = int(logits[0].argmin())
    greedy = SamplingParams(temperature=0.0, logit_bias=((worst, 100.0),))
    assert sample(logits.clone(), [greedy], [None]) == [worst]
    best = int(logits[0].argmax())
    banned = SamplingParams(temperature=2.0, seed=1, logit_bias=((best, -100.0),))
    generator = make_generator(banned, torch.device("cpu"))
    drawn = [sample(logits.clone(), [banned], [generator])[0] for _ in range(300)]
    assert best not in drawn and len(set(drawn)) > 5


def test_presence_penalty_moves_sampling_off_repeated_tokens() -> None:
    logits = torch.zeros(1, 10)  # uniform: every token equally likely
    counts = torch.zeros(10)
    counts[:5] = 1  # tokens 0-4 were generated already
    params = SamplingParams(temperature=1.0, seed=2, presence_penalty=2.0)
    generator = make_generator(params, torch.device("cpu"))
    drawn = [sample(logits.clone(), [params], [generator], [counts])[0] for _ in range(2000)]
    repeated = sum(token < 5 for token in drawn) / len(drawn)
    # P(a repeated token) = 5 e^-2 / (5 e^-2 + 5) = 0.119
    assert abs(repeated - 0.119) < 0.03


def test_penalized_rows_need_their_counts() -> None:
    with pytest.raises(ValueError, match="no token counts"):
        sample(logits_batch(0)[:1], [SamplingParams(frequency_penalty=1.0)], [None], [None])


def test_logprobs_are_taken_before_the_bias_changes_the_logits() -> None:
    logits = logits_batch(6)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias=((9, 100.0),)),
        SamplingParams(temperature=0.0),  # asks for none
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    expected = torch.log_softmax(logits, -1)
    raw = raw_logprobs(logits, params)
    tokens = sample(logits, params, [None] * 3)
    assert tokens[0] == 9  # the bias chose it
    chosen = chosen_logprobs(raw, params, tokens)
    first, second, third = chosen
    assert first is not None and second is None and third is not None
    assert abs(first.logprob - float(expected[0, 9])) < 1e-6  # the model's, not the biased one
    assert [token for token, _ in first.top] == torch.topk(expected[0], 2).indices.tolist()
    assert third.top == () and third.token == int(expected[2].argmax())


def test_a_failed_row_gets_no_logprobs() -> None:
    logits = logits_batch(7)[:2]
    logits[1, 3] = float("nan")
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 2
    raw = raw_logprobs(logits, params)
    tokens = sample(logits, params, [None, None])
    assert isinstance(tokens[1], RequestFailed)
    chosen = chosen_logprobs(raw, params, tokens)
    assert chosen[0] is not None and chosen[1] is None
