"""OpenAI response objects: chat.completion, chat.completion.chunk, text_completion."""

from __future__ import annotations

from typing import Any

from engine.request import Usage


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_completion(
    response_id: str, created: int, model: str, text: str, finish: str | None, usage: Usage
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage_json(usage),
    }


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A streamed chunk; `delta=None` makes the usage-only chunk with empty choices."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage_json(usage)
    return chunk


def text_completion(
    response_id: str,
    created: int,
    model: str,
    text: str | None,
    finish: str | None,
    usage: Usage | None,
) -> dict[str, Any]:
    """A text completion, or one streamed piece of it (`text=None`: the usage-only chunk)."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": []
        if text is None
        else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage_json(usage)
    return body
