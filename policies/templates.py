"""Where a chat template puts the boundary between the system prompt and the user's text."""

from __future__ import annotations

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
    """Token ids of a conversation and where each message lies in them."""
    from policies.planner import MessageSpan

    token_ids = render(tokenizer, messages, generation_prompt)
    spans, start = [], 0
    for index, message in enumerate(messages):
        end = len(render(tokenizer, messages[: index + 1], generation_prompt=False))
        end = min(max(end, start), len(token_ids))
        spans.append(MessageSpan(message["role"], start, end))
        start = end
    return token_ids, spans
