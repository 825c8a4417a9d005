"""OpenAI response objects: chat.completion, chat.completion.chunk, text_completion, and the
logprobs objects of both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.request import Usage
from engine.sampler import TokenLogprobs

# What OpenAI reports for a token too unlikely to have a finite float32 logprob.
LOWEST_LOGPROB = -9999.0


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_choice(
    index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One of a chat completion's `choices`."""
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_completion(
    response_id: str, created: int, model: str, choices: list[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(usage),
    }


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    usage: Usage | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A streamed chunk of choice `index`; `delta=None` makes the usage-only chunk with
    empty choices."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage_json(usage)
    return chunk


def text_choice(
    index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One of a text completion's `choices`, or one streamed piece of it."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def text_completion(
    response_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: Usage | None,
) -> dict[str, Any]:
    """A text completion, or one streamed piece of it (no choices: the usage-only chunk)."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage_json(usage)
    return body


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as text (`token_id:N` for a model without a tokenizer, as vLLM writes it)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return str(tokenizer.decode([token_id]))


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def chat_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion or chunk."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = [
        entry(item.token, item.logprob)
        | {"top_logprobs": [entry(token, logprob) for token, logprob in item.top]}
        for item in logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Any, logprobs: Sequence[TokenLogprobs], text_offset: int
) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion; `text_offset` is where its first token's
    text starts in the completion's text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in logprobs:
        text = token_text(tokenizer, item.token)
        tokens.append(text)
        token_logprobs.append(_finite(item.logprob))
        top.append({token_text(tokenizer, t): _finite(value) for t, value in item.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
