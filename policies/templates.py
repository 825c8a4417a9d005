"""Where a chat template puts the boundary between the system prompt and the user's text."""

from __future__ import annotations

import bisect
from typing import Any

# Two user messages that share no first character, so renderings diverge at the user text.
_PROBES = ("A", "\u2603 z")


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """Token ids of a conversation rendered by the model's own chat template."""
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True
    )
    ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    return [int(token_id) for token_id in ids]


def system_prompt_tokens(tokenizer: Any, system_text: str) -> list[int]:
    """The token ids every conversation with this system prompt starts with.

    Rendered as the template renders it in front of a user turn, cut where two different user
    turns diverge: template tokens up to the user's text are included, the user's text never
    is, wherever the template puts the boundary.
    """
    first, second = (
        render(
            tokenizer,
            [{"role": "system", "content": system_text}, {"role": "user", "content": probe}],
            generation_prompt=True,
        )
        for probe in _PROBES
    )
    common = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        common += 1
    return first[:common]


def render_with_spans(
    tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = True
) -> tuple[list[int], list[Any]]:
    """Token ids of a conversation and where each message lies in them.

    One tokenization: the template renders each prefix of the conversation as text (cheap),
    and character offsets map those boundaries onto the tokens of the whole rendering. The
    last message's span runs to the end, generation prompt included.
    """
    from policies.planner import MessageSpan

    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    token_ids, starts = _encode_with_offsets(tokenizer, text)
    spans, start_token = [], 0
    for index, message in enumerate(messages):
        if index == len(messages) - 1:  # the last one runs to the end (generation prompt too)
            end_token = len(token_ids)
        else:
            prefix = tokenizer.apply_chat_template(
                messages[: index + 1], add_generation_prompt=False, tokenize=False
            )
            end_char = len(prefix) if text.startswith(prefix) else len(text)
            end_token = bisect.bisect_left(starts, end_char, lo=start_token)
        spans.append(MessageSpan(message["role"], start_token, end_token))
        start_token = end_token
    return token_ids, spans


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Token ids and each token's first character; the Rust backend directly when there is one
    (the Python wrapper costs as much again)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoding = backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [start for start, _ in encoding.offsets]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(i) for i in encoded["input_ids"]], [s for s, _ in encoded["offset_mapping"]]
