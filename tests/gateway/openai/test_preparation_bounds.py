"""Bounds preparation puts on what a request may make the gateway build."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.openai.preparation import MAX_PROMPT_LOGPROB_ENTRIES, _prompt_logprobs
from gateway.openai.schemas import CompletionRequest


def test_echoed_prompt_logprobs_are_bounded_over_all_choices() -> None:
    body = CompletionRequest(model="m", prompt="x", echo=True, logprobs=20, n=8)
    fits = MAX_PROMPT_LOGPROB_ENTRIES // (8 * 21)
    assert _prompt_logprobs(body, fits) == 20
    with pytest.raises(APIError) as refused:
        _prompt_logprobs(body, fits + 1)
    assert refused.value.status == 400 and refused.value.param == "logprobs"
    alone = CompletionRequest(model="m", prompt="x", echo=True, logprobs=20)
    assert _prompt_logprobs(alone, fits * 8) == 20  # one choice may have an 8x longer prompt
    assert _prompt_logprobs(CompletionRequest(model="m", prompt="x", logprobs=5), 10**6) is None
