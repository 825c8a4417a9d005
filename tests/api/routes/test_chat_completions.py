"""POST /v1/chat/completions: the official `openai` client's calls, and each invalid request
refused with its status and OpenAI's error shape."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

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


CASES = [
    ("n-two", chat(n=2), 400, "n", None),
    ("unsupported-field", chat(logprobs=True), 400, "logprobs", None),
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
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), CASES,
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_an_invalid_chat_request_is_refused_with_its_status_param_and_code(
    gateway: Gateway, name: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    assert_error(post(gateway, body), status, param, code)
