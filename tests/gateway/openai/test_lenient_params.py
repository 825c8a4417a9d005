"""Fields OpenAI clients send that change nothing here are accepted; an operator can have
unknown fields dropped instead of refused (`drop_unknown_params`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway import MODEL, Gateway, openai_client, sqlite_gateway
from tests.support.openai_errors import assert_error, chat, post


def test_fields_without_effect_are_accepted(gateway: Gateway) -> None:
    api = openai_client(gateway)
    messages = [{"role": "user", "content": "Say something."}]
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                        temperature=0)  # fmt: skip
    lenient = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, store=True,
        metadata={"trace": "abc", "team": "search"}, service_tier="auto",
        response_format={"type": "text"}, logprobs=False, user="someone", n=1,
    )  # fmt: skip
    assert lenient.choices[0].message.content == plain.choices[0].message.content
    completion = api.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=False,
                                        extra_body={"store": False})  # fmt: skip
    assert completion.usage is not None and completion.usage.completion_tokens >= 1


STRICT_CASES = [
    ("metadata-17-keys", chat(metadata={str(i): "v" for i in range(17)}), "metadata"),
    ("metadata-long-value", chat(metadata={"k": "v" * 513}), "metadata"),
    ("service-tier", chat(service_tier="gold"), "service_tier"),
    ("logprobs-not-a-bool", chat(logprobs=1), "logprobs"),
    ("unknown-field", chat(frobnicate=1), "frobnicate"),
]


@pytest.mark.parametrize(("name", "body", "param"), STRICT_CASES,
                         ids=[case[0] for case in STRICT_CASES])  # fmt: skip
def test_other_values_are_still_refused_naming_the_field(
    gateway: Gateway, name: str, body: Any, param: str
) -> None:
    assert_error(post(gateway, body), 400, param, None)


@pytest.fixture(scope="module")
def dropping_gateway(
    tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A gateway on SQLite with `drop_unknown_params`: (base URL, an API key)."""
    state_dir = tmp_path_factory.mktemp("dropping-gateway")
    settings = {"model_dir": tiny_chat_dir, "kv_cache_bytes": 16 << 20, "drop_unknown_params": True}
    with sqlite_gateway(state_dir, **settings) as (server, key):
        yield f"{server.url}/v1", key


def test_unknown_fields_are_dropped_and_logged_once_when_the_operator_says_so(
    dropping_gateway: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    base_url, key = dropping_gateway
    body = chat(frobnicate={"deep": [1, 2]}, x_vendor_hint="fast", max_tokens=3, temperature=0)
    with caplog.at_level(logging.WARNING, logger="gateway.openai.routes"):
        for _ in range(2):
            answer = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60,
                                headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            assert answer.status_code == 200, answer.text
    logged = [r.getMessage() for r in caplog.records if "dropping unknown" in r.getMessage()]
    assert sorted(logged) == [
        "dropping unknown request field 'frobnicate' (drop_unknown_params)",
        "dropping unknown request field 'x_vendor_hint' (drop_unknown_params)",
    ]
    # Known fields are still checked.
    bad = httpx.post(f"{base_url}/chat/completions", json=chat(temperature=9), timeout=60,
                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
