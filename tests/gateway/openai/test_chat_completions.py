"""POST /v1/chat/completions: the official `openai` client's calls, and each invalid request
refused with its status and OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import jsonschema
import openai
import pytest

from engine.sampling.sampler import TokenLogprobs
from gateway.openai.responses import chat_logprobs
from tests.support.gateway import MODEL, Gateway, openai_client
from tests.support.openai_errors import assert_error, chat, post


def test_a_chat_completion_has_openai_shape_and_a_new_user_has_nothing_cached(
    gateway: Gateway,
) -> None:
    response = openai_client(gateway).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
        user=f"first-timer-{uuid.uuid4()}",  # nothing of this user's is cached yet
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert response.usage is not None and response.usage.completion_tokens <= 8
    assert response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_with_usage_matches_the_blocking_answer(gateway: Gateway) -> None:
    api = openai_client(gateway)
    messages = [{"role": "user", "content": "Count to five."}]
    blocking = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0)  # fmt: skip
    chunks = list(
        api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == blocking.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens_details is not None


def test_penalties_and_logit_bias_as_clients_send_them(gateway: Gateway) -> None:
    api = openai_client(gateway)
    messages = [{"role": "user", "content": "Say something."}]
    # What frameworks send on every call: zero penalties, an empty bias.
    defaults = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, frequency_penalty=0,
        presence_penalty=0, logit_bias={},
    )  # fmt: skip
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                        temperature=0)  # fmt: skip
    assert defaults.choices[0].message.content == plain.choices[0].message.content
    # A +100 bias on one token makes it the only choice.
    served = gateway.server.gateway.models.get(MODEL)
    assert served is not None
    loaded = served.loaded
    word = loaded.tokenizer.encode(" yes", add_special_tokens=False)[0]
    forced = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=1, seed=3,
        logit_bias={str(word): 100}, frequency_penalty=0.5, presence_penalty=-0.5,
    )  # fmt: skip
    assert forced.choices[0].message.content == loaded.tokenizer.decode([word] * 4)
    assert forced.usage is not None and forced.usage.completion_tokens == 4
    past_vocabulary = chat(logit_bias={str(loaded.vocab_size): 1})
    assert_error(post(gateway, past_vocabulary), 400, "logit_bias", None)


def test_logprob_bytes_are_the_tokens_own_even_for_part_of_a_character(
    smollm2_tokenizer: Any,
) -> None:
    # SmolLM2 splits the emoji (F0 9F 98 80) over two tokens; neither decodes alone.
    ids = smollm2_tokenizer.encode(" 😀", add_special_tokens=False)
    items = [TokenLogprobs(token, -0.25, ((token, -0.25),)) for token in ids]

    content = chat_logprobs(smollm2_tokenizer, items)["content"]

    assert [entry["bytes"] for entry in content] == [[0x20, 0xF0, 0x9F, 0x98], [0x80]]
    assert [entry["top_logprobs"][0]["bytes"] for entry in content] == [
        [0x20, 0xF0, 0x9F, 0x98],
        [0x80],
    ]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == " 😀"


def test_logprobs_in_openais_shape_blocking_and_streamed_alike(gateway: Gateway) -> None:
    api = openai_client(gateway)
    arguments: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip
    blocking = api.chat.completions.create(**arguments)
    logprobs = blocking.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert blocking.usage is not None and len(logprobs.content) == blocking.usage.completion_tokens
    for item in logprobs.content:
        assert item.logprob <= 0
        if "\ufffd" not in item.token:  # a whole token: its bytes are its text's
            assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        values = [top.logprob for top in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the likeliest.
        assert (item.token, item.logprob) == (item.top_logprobs[0].token, values[0])
    chunks = list(api.chat.completions.create(**arguments, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs
                for item in c.choices[0].logprobs.content or []]  # fmt: skip
    # The same tokens. The logprobs agree to about 1e-4, not bit for bit: they are fp32, and
    # the streamed request finds the prompt's first blocks cached, so it computes fewer
    # positions, whose attention may take the other kernel path (vector or matrix).
    assert [i.token for i in streamed] == [i.token for i in logprobs.content]
    for mine, theirs in zip(streamed, logprobs.content, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)
    plain = api.chat.completions.create(**(arguments | {"logprobs": False, "top_logprobs": None}))
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == blocking.choices[0].message.content


def test_n_choices_share_one_prompt_blocking_and_streamed_alike(gateway: Gateway) -> None:
    api = openai_client(gateway)
    arguments: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Name an animal."}],
        "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": True,
        "user": f"choices-{uuid.uuid4()}",
    }  # fmt: skip
    one = api.chat.completions.create(**arguments)
    blocking = api.chat.completions.create(**arguments, n=3)
    assert [choice.index for choice in blocking.choices] == [0, 1, 2]
    assert blocking.choices[0].message.content == one.choices[0].message.content
    assert len({choice.message.content for choice in blocking.choices}) > 1, "seeds differ"
    assert blocking.usage is not None and one.usage is not None
    assert blocking.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    lengths = [len(choice.logprobs.content or []) for choice in blocking.choices if choice.logprobs]
    assert blocking.usage.completion_tokens == sum(lengths) and len(lengths) == 3
    chunks = list(api.chat.completions.create(**arguments, n=3, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [choice.message.content for choice in blocking.choices]
    assert finishes == [choice.finish_reason for choice in blocking.choices]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == blocking.usage.completion_tokens
    assert usage.prompt_tokens == one.usage.prompt_tokens
    assert len(post(gateway, chat(n=None)).json()["choices"]) == 1  # null: the default


BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "colour", "count"], "additionalProperties": False,
}  # fmt: skip


def test_structured_output_follows_its_schema(gateway: Gateway) -> None:
    api = openai_client(gateway)
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": BOUNDED_SCHEMA, "strict": True},
    }
    for seed in range(3):
        completion = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer."}], max_tokens=60,
            temperature=1.0, seed=seed, response_format=response_format,
        )  # fmt: skip
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), BOUNDED_SCHEMA)
    refused = post(
        gateway,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"not": {}}}},
                },
            }
        ),
    )
    error = assert_error(refused, 400, "response_format")
    assert "'not' (at #/properties/a)" in error["message"]


CASES = [
    ("n-over-the-limit", chat(n=9), 400, "n", None),
    ("n-zero", chat(n=0), 400, "n", None),
    ("stop-with-format", chat(stop=["}"], response_format={"type": "json_object"}), 400, "stop",
     None),
    ("same-tool-twice", chat(tool_choice="none", tools=[
        {"type": "function", "function": {"name": "f"}}] * 2), 400, "tools", None),
    ("schema-name", chat(response_format={"type": "json_schema",
                                          "json_schema": {"name": "no spaces", "schema": {}}}),
     400, "response_format", None),
    ("format-type", chat(response_format={"type": "xml"}), 400, "response_format", None),
    ("unsupported-field", chat(echo=True), 400, "echo", None),
    ("top-logprobs-alone", chat(top_logprobs=2), 400, "top_logprobs", None),
    ("top-logprobs-21", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("tools", chat(tools=[]), 400, "tools", None),
    ("temperature", chat(temperature=5), 400, "temperature", None),
    ("top-p", chat(top_p=0), 400, "top_p", None),
    ("max-tokens", chat(max_tokens=0), 400, "max_tokens", None),
    ("no-messages", {"model": MODEL}, 400, "messages", None),
    ("empty-messages", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("bad-role", chat(messages=[{"role": "wizard", "content": "x"}]), 400, None, None),
    ("image", chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                           "image_url": {"url": "x"}}]}]),
     400, None, None),
    ("stream-options-alone", chat(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("unknown-model", chat(model="gpt-9"), 404, "model", "model_not_found"),
    ("too-long", chat(messages=[{"role": "user", "content": "word " * 2000}]), 400, "messages",
     "context_length_exceeded"),
    ("frequency-penalty", chat(frequency_penalty=2.5), 400, "frequency_penalty", None),
    ("presence-penalty", chat(presence_penalty="0"), 400, "presence_penalty", None),
    ("bias-value", chat(logit_bias={"5": -101}), 400, "logit_bias", None),
    ("bias-key", chat(logit_bias={"five": 1}), 400, "logit_bias", None),
    ("bias-key-huge", chat(logit_bias={"9" * 5000: 1}), 400, "logit_bias", None),
    ("bias-too-many", chat(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias",
     None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), CASES,
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_an_invalid_chat_request_is_refused_with_its_status_param_and_code(
    gateway: Gateway, name: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    assert_error(post(gateway, body), status, param, code)


def test_the_async_client_streams_and_a_seeded_n_request_repeats_itself(gateway: Gateway) -> None:
    async def run() -> None:
        api = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=gateway.keys["acme"],
                                 max_retries=0)  # fmt: skip
        arguments: Any = {
            "model": MODEL, "messages": [{"role": "user", "content": "Pick a fruit."}],
            "max_tokens": 6, "temperature": 1.0, "seed": 21, "n": 3,
        }  # fmt: skip
        first = await api.chat.completions.create(**arguments)
        again = await api.chat.completions.create(**arguments)
        answers = [choice.message.content for choice in first.choices]
        assert answers == [choice.message.content for choice in again.choices]
        texts = ["", "", ""]
        async for chunk in await api.chat.completions.create(**arguments, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        assert texts == answers
        await api.close()

    asyncio.run(run())
