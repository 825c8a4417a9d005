"""Sampler parameters, seeds, stop strings and incremental detokenization."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.detokenizer import Detokenizer
from engine.sampler import InvalidSampling, SamplingParams, make_generator, sample
from tests.support.models import engine_for, make_request, run_one


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
    ],
)
def test_invalid_sampling_names_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSampling) as raised:
        SamplingParams(**fields)
    assert raised.value.param == param


def test_seeded_requests_reproduce_through_the_engine() -> None:
    engine = engine_for("llama")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42)
    first = run_one(engine, make_request("a", list(range(20)), sampling=params)).token_ids
    second = run_one(engine, make_request("b", list(range(20)), sampling=params)).token_ids
    assert first == second


def feed(detokenizer: Detokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in token_ids]


def test_detokenizer_streams_the_same_text_as_a_full_decode(smollm2_tokenizer: Any) -> None:
    text = "Héllo wörld — naïve café, 東京 and emoji 🙂 spaced  out."
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    detokenizer = Detokenizer(smollm2_tokenizer, smollm2_tokenizer.encode("Say:"), stop=())
    streamed = "".join(feed(detokenizer, ids)) + detokenizer.flush()
    assert streamed == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_across_tokens_is_never_released(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("The answer is 42. END of story", add_special_tokens=False)
    detokenizer = Detokenizer(smollm2_tokenizer, [], stop=("END",))
    pieces = feed(detokenizer, ids)
    released = "".join(pieces)
    assert detokenizer.stopped
    assert released == "The answer is 42. "
    assert "E" not in "".join(pieces)


def test_text_that_might_start_a_stop_string_is_held_back(smollm2_tokenizer: Any) -> None:
    detokenizer = Detokenizer(smollm2_tokenizer, [], stop=("STOP!",))
    ids = smollm2_tokenizer.encode("go ST", add_special_tokens=False)
    assert "".join(feed(detokenizer, ids)) == "go "
    assert detokenizer.flush() == "ST"
