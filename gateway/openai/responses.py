"""OpenAI response objects: chat.completion, chat.completion.chunk, text_completion, and the
logprobs objects of both."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from engine.request import Usage
from engine.sampling.detokenizer import Detokenizer
from engine.sampling.sampler import TokenLogprobs
from engine.sampling.token_bytes import token_bytes

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
    index: int,
    text: str | None,
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One of a chat completion's `choices` (`text` None: an answer that only calls tools)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
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
    """A token as text (`token_id:N` for a model without a tokenizer, as vLLM writes it).

    Remembered per tokenizer (at most one entry per vocabulary id): logprobs with 20
    alternatives name 21 tokens per generated token, mostly the same few thousand.
    """
    if tokenizer is None:
        return f"token_id:{token_id}"
    texts = _token_texts.get(tokenizer)
    if texts is None:
        texts = _token_texts.setdefault(tokenizer, {})
    text = texts.get(token_id)
    if text is None:
        text = texts[token_id] = str(tokenizer.decode([token_id]))
    return text


# Per tokenizer: token id -> its text. Racing threads may both decode a token; same result.
_token_texts: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def chat_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion or chunk."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(tokenizer, token_id), token_bytes(tokenizer, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    content = [
        entry(item.token, item.logprob)
        | {"top_logprobs": [entry(token, logprob) for token, logprob in item.top]}
        for item in logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Any, logprobs: Sequence[TokenLogprobs], offsets: Sequence[int]
) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion; `offsets` are where each token's text
    starts in the choice's text (a token that ends a character split over tokens starts
    where that character does)."""
    tokens, token_logprobs, top = [], [], []
    for item in logprobs:
        names = _distinct_names(tokenizer, [token for token, _ in item.top])
        tokens.append(names.get(item.token) or token_text(tokenizer, item.token))
        token_logprobs.append(_finite(item.logprob))
        top.append({names[token]: _finite(value) for token, value in item.top})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


def _distinct_names(tokenizer: Any, token_ids: Sequence[int]) -> dict[int, str]:
    """A key for each token of a completion's `top_logprobs` (likeliest first), distinct
    where their texts are not: two tokens that decode alike (parts of UTF-8 characters both
    decode to the replacement character) would otherwise share one key, and one's logprob
    would be lost.

    The likelier keeps its text; a later one is named by its bytes (`bytes:` and `\\xNN` per
    byte), or by its id (`token_id:N`, vLLM's form) where even those are alike.
    """
    names: dict[int, str] = {}
    taken: set[str] = set()
    for token in token_ids:
        name = token_text(tokenizer, token)
        if name in taken:
            name = "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes(tokenizer, token))
        if name in taken:
            name = f"token_id:{token}"
        names[token] = name
        taken.add(name)
    return names


def echoed_logprobs(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    scored: Sequence[TokenLogprobs],
    output: dict[str, Any],
) -> dict[str, Any]:
    """A completion's `logprobs` with its echoed prompt's in front: the first prompt token
    has none (null), as in OpenAI's API; `output` is the completion's own."""
    first = token_text(tokenizer, prompt_ids[0])
    prompt = completion_logprobs(tokenizer, scored, prompt_offsets(tokenizer, prompt_ids)[1:])
    return {
        "tokens": [first, *prompt["tokens"], *output["tokens"]],
        "token_logprobs": [None, *prompt["token_logprobs"], *output["token_logprobs"]],
        "top_logprobs": [None, *prompt["top_logprobs"], *output["top_logprobs"]],
        "text_offset": [0, *prompt["text_offset"], *output["text_offset"]],
    }


def prompt_offsets(tokenizer: Any, prompt_ids: Sequence[int]) -> list[int]:
    """Where each prompt token's text starts in the prompt's text, decoded as the output is
    (characters split over tokens are whole, at the token that completes them)."""
    if tokenizer is None:
        lengths = [len(token_text(None, token)) for token in prompt_ids]
    else:
        detokenizer = Detokenizer(tokenizer, [], ())
        lengths = [len(detokenizer.add(token)) for token in prompt_ids]
    return [0, *itertools.accumulate(lengths)][:-1]
