"""POST /v1/completions through the official `openai` client."""

from __future__ import annotations

from typing import Any

from engine.sampling.sampler import TokenLogprobs
from engine.sampling.token_bytes import bytes_to_unicode
from gateway.openai.responses import completion_logprobs
from tests.support.gateway import MODEL, Gateway, openai_client
from tests.support.openai_errors import assert_error, post


def test_a_completion_takes_a_text_or_token_id_prompt_and_counts_its_tokens(
    gateway: Gateway,
) -> None:
    api = openai_client(gateway)
    by_text = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                     temperature=0)  # fmt: skip
    assert by_text.object == "text_completion" and by_text.usage is not None
    assert by_text.usage.completion_tokens == 5
    by_ids = api.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 4


def test_top_logprobs_keep_a_key_for_each_token_when_two_decode_alike(
    smollm2_tokenizer: Any,
) -> None:
    # Two byte-level tokens that are each one continuation byte: both decode to U+FFFD.
    first, second = (
        smollm2_tokenizer.convert_tokens_to_ids(bytes_to_unicode()[byte]) for byte in (0x80, 0x81)
    )
    assert smollm2_tokenizer.decode([first]) == smollm2_tokenizer.decode([second]) == "\ufffd"
    top = ((first, -0.5), (second, -1.0))
    sampled_first = TokenLogprobs(first, -0.5, top)
    sampled_second = TokenLogprobs(second, -1.0, top)

    logprobs = completion_logprobs(smollm2_tokenizer, [sampled_first, sampled_second], [0, 1])

    assert logprobs["top_logprobs"] == [{"\ufffd": -0.5, "bytes:\\x81": -1.0}] * 2
    # Each sampled token is named as its alternatives name it, so it can be looked up.
    assert logprobs["tokens"] == ["\ufffd", "bytes:\\x81"]
    for token, value, alternatives in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert alternatives[token] == value


def test_a_streamed_completion_is_text_completion_chunks_ending_with_its_finish_reason(
    gateway: Gateway,
) -> None:
    chunks = list(openai_client(gateway).completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, stream=True))  # fmt: skip
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_list_tokens_their_logprobs_alternatives_and_offsets(
    gateway: Gateway,
) -> None:
    api = openai_client(gateway)
    completion = api.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                        temperature=0, logprobs=2)  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and completion.usage is not None
    tokens, values = logprobs.tokens or [], logprobs.token_logprobs or []
    assert len(tokens) == len(values) == completion.usage.completion_tokens
    assert all(value <= 0 for value in values)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [])
    offsets, text = logprobs.text_offset or [], completion.choices[0].text
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    if "".join(tokens) == text:  # no character split over tokens: each starts where it ends
        assert offsets == [sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]
    streamed = list(api.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                           temperature=0, logprobs=2, stream=True))  # fmt: skip
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for piece in pieces for t in piece.tokens or []] == tokens
    assert [o for piece in pieces for o in piece.text_offset or []] == offsets
    refused = post(gateway, {"model": MODEL, "prompt": "x", "logprobs": 21},
                   path="/v1/completions")  # fmt: skip
    assert_error(refused, 400, "logprobs")


def test_n_completions_stream_each_choice_with_its_own_offsets(gateway: Gateway) -> None:
    api = openai_client(gateway)
    arguments = {"model": MODEL, "prompt": "My favourite food is", "max_tokens": 6,
                 "temperature": 1.0, "seed": 5, "logprobs": 1, "n": 2}  # fmt: skip
    blocking = api.completions.create(**arguments)  # type: ignore[call-overload]
    assert [choice.index for choice in blocking.choices] == [0, 1]
    streamed = list(api.completions.create(**arguments, stream=True))  # type: ignore[call-overload]
    for index, choice in enumerate(blocking.choices):
        pieces = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == index]
        assert "".join(piece.text for piece in pieces) == choice.text
        offsets = [
            o for piece in pieces if piece.logprobs for o in piece.logprobs.text_offset or []
        ]
        assert choice.logprobs is not None and offsets == choice.logprobs.text_offset
    assert blocking.usage is not None
    assert blocking.usage.completion_tokens == sum(
        len(choice.logprobs.tokens or []) for choice in blocking.choices if choice.logprobs
    )


def test_echo_returns_the_prompt_before_the_output_and_scores_it_with_logprobs(
    gateway: Gateway,
) -> None:
    api = openai_client(gateway)
    prompt = "The capital of France is"
    plain = api.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    echoed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True)  # fmt: skip
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    arguments = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                 "echo": True, "logprobs": 2}  # fmt: skip
    scored = api.completions.create(**arguments)  # type: ignore[call-overload]
    logprobs, usage = scored.choices[0].logprobs, scored.usage
    assert logprobs is not None and usage is not None
    tokens, values = logprobs.tokens or [], logprobs.token_logprobs or []
    assert len(tokens) == len(values) == usage.prompt_tokens + usage.completion_tokens
    assert values[0] is None and (logprobs.top_logprobs or [])[0] is None
    assert all(value is not None and value <= 0 for value in values[1:])
    assert "".join(tokens) == scored.choices[0].text
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0  # scored, so computed
    streamed = list(api.completions.create(**arguments, stream=True))  # type: ignore[call-overload]
    pieces = [c.choices[0] for c in streamed if c.choices]
    assert "".join(piece.text for piece in pieces) == scored.choices[0].text
    streamed_tokens = [t for p in pieces if p.logprobs for t in p.logprobs.tokens or []]
    streamed_offsets = [o for p in pieces if p.logprobs for o in p.logprobs.text_offset or []]
    assert streamed_tokens == tokens and streamed_offsets == logprobs.text_offset


def test_offsets_follow_the_text_where_a_character_spans_tokens(gateway: Gateway) -> None:
    prompt = "Café 日本語 🙂 naïve — ok"
    api = openai_client(gateway)
    arguments = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                 "echo": True, "logprobs": 1}  # fmt: skip
    completion = api.completions.create(**arguments)  # type: ignore[call-overload]
    choice, usage = completion.choices[0], completion.usage
    assert choice.logprobs is not None and usage is not None
    offsets, text = choice.logprobs.text_offset or [], choice.text
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    # The prompt's last token, " ok", starts where " ok" does in the text.
    assert text[offsets[usage.prompt_tokens - 1] :].startswith(" ok")
    streamed = list(api.completions.create(**arguments, stream=True))  # type: ignore[call-overload]
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [o for piece in pieces for o in piece.text_offset or []] == offsets
