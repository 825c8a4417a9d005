"""Seeded sampling through the engine, and incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any

from engine.detokenizer import Detokenizer
from engine.sampler import SamplingParams
from tests.support.models import engine_for, make_request, run_one


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
