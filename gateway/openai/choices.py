"""A request's n choices as they stream in, and the blocking response made of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.request import GenerationDelta, Usage
from engine.sampling.sampler import TokenLogprobs
from gateway.openai.responses import (
    chat_choice,
    chat_completion,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    text_choice,
    text_completion,
)
from gateway.openai.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from gateway.openai.preparation import Prepared


class Choices:
    """What has streamed so far of each of a request's n choices."""

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        # Where each token of `logprobs` starts in its choice's text.
        self.offsets: list[list[int]] = [[] for _ in range(n)]
        self.prompt_logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self.finishes: list[str | None] = [None] * n
        self.usages: list[Usage] = []
        self.last: GenerationDelta | None = None  # the delta that ended the last choice

    def add(self, delta: GenerationDelta) -> None:
        index = delta.index
        self.offsets[index] += [len(self.texts[index])] * len(delta.logprobs or [])
        self.texts[delta.index] += delta.text
        self.logprobs[delta.index] += delta.logprobs or []
        self.prompt_logprobs[delta.index] += delta.prompt_logprobs or []
        if delta.finish_reason is not None:
            self.finishes[delta.index] = delta.finish_reason
            if delta.usage is not None:
                self.usages.append(delta.usage)
            if self.done:
                self.last = delta

    @property
    def done(self) -> bool:
        return all(self.finishes)

    def usage(self, prompt_tokens: int) -> Usage:
        """The request's usage: the prompt once (choice 0 counts it), every choice's output."""
        if not self.usages:
            return Usage(prompt_tokens, 0, 0)
        return Usage(
            sum(usage.prompt_tokens for usage in self.usages),
            sum(usage.cached_tokens for usage in self.usages),
            sum(usage.completion_tokens for usage in self.usages),
            # Choice 0 counts the prompt, and so carries where its cached tokens came from.
            next((usage.cache for usage in self.usages if usage.cache is not None), None),
        )


def completion_body(
    tokenizer: Any, model: str, prepared: Prepared, choices: Choices, usage: Usage
) -> dict[str, Any]:
    """The chat.completion or text_completion of a finished request."""
    if prepared.context.endpoint == "chat":
        bodies = [_chat_choice(tokenizer, prepared, choices, i) for i in range(len(choices.texts))]
        return chat_completion(prepared.response_id, prepared.created, model, bodies, usage)
    bodies = [_text_choice(tokenizer, prepared, choices, i) for i in range(len(choices.texts))]
    return text_completion(prepared.response_id, prepared.created, model, bodies, usage)


def _chat_choice(
    tokenizer: Any, prepared: Prepared, choices: Choices, index: int
) -> dict[str, Any]:
    text, finish, logprobs = choices.texts[index], choices.finishes[index], None
    if prepared.request.sampling.logprobs is not None:
        logprobs = chat_logprobs(tokenizer, choices.logprobs[index])
    if not prepared.tool_calls:
        return chat_choice(index, text, finish, logprobs)
    content, calls = parse_tool_calls(text)
    finish = "tool_calls" if calls and finish == "stop" else finish
    entries = [call.message_entry() for call in calls]
    return chat_choice(index, content, finish, logprobs, entries)


def _text_choice(
    tokenizer: Any, prepared: Prepared, choices: Choices, index: int
) -> dict[str, Any]:
    """A completion's choice; one that echoes its prompt has it (and its logprobs) in front."""
    text, finish, logprobs, echo = (
        choices.texts[index],
        choices.finishes[index],
        None,
        prepared.echo,
    )
    if prepared.request.sampling.logprobs is not None:
        shift = len(echo or "")
        offsets = [offset + shift for offset in choices.offsets[index]]
        logprobs = completion_logprobs(tokenizer, choices.logprobs[index], offsets)
        if echo is not None:
            prompt_ids, scored = prepared.request.prompt_token_ids, choices.prompt_logprobs[index]
            logprobs = echoed_logprobs(tokenizer, prompt_ids, scored, logprobs)
    return text_choice(index, text if echo is None else echo + text, finish, logprobs)
