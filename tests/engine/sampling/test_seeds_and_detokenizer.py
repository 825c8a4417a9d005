"""Seeded sampling, penalties and logit bias through the engine, and incremental
detokenization with stop strings."""

from __future__ import annotations

from typing import Any

import torch

from engine.sampling.detokenizer import Detokenizer
from engine.sampling.sampler import SamplingParams
from tests.support.models import (
    engine_for,
    make_request,
    reference_copy,
    run_one,
    tiny_model,
)


def test_seeded_requests_reproduce_through_the_engine() -> None:
    engine = engine_for("llama")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42)
    first = run_one(engine, make_request("a", list(range(20)), sampling=params)).token_ids
    second = run_one(engine, make_request("b", list(range(20)), sampling=params)).token_ids
    assert first == second


def test_penalized_greedy_output_equals_a_direct_computation() -> None:
    # The model's own forward over the whole text each step, penalties applied by hand.
    reference = reference_copy(tiny_model("llama"))
    # Negative penalties: a random model seldom repeats a token on its own, now it must.
    prompt, frequency, presence = list(range(3, 23)), -1.5, -0.75
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(10):
            logits = reference(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(logits))
            logits -= counts * frequency + (counts > 0) * presence
            tokens.append(int(logits.argmax()))
    params = SamplingParams(
        max_tokens=10, temperature=0.0, frequency_penalty=frequency, presence_penalty=presence,
        ignore_eos=True,
    )  # fmt: skip
    served = run_one(engine_for("llama"), make_request("p", prompt, sampling=params)).token_ids
    assert served == tokens
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert (
        run_one(engine_for("llama"), make_request("q", prompt, sampling=plain)).token_ids != tokens
    )


def test_logit_bias_forces_a_token_through_the_engine() -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, logit_bias=((42, 100.0),))
    served = run_one(engine_for("llama"), make_request("b", list(range(20)), sampling=params))
    assert served.token_ids == [42] * 6


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
