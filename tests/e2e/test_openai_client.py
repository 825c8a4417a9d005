"""The unmodified official `openai` client against a real gateway over a real socket."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.e2e.conftest import MODEL, SYSTEM_PROMPT, Gateway


def client(gateway: Gateway, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=gateway.keys[tenant], max_retries=0)


def test_models_list(gateway: Gateway) -> None:
    models = client(gateway).models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_chat_completion(gateway: Gateway) -> None:
    response = client(gateway).chat.completions.create(
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


def test_completions_with_text_and_token_ids(gateway: Gateway) -> None:
    api = client(gateway)
    by_text = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                     temperature=0)  # fmt: skip
    assert by_text.object == "text_completion" and by_text.usage is not None
    assert by_text.usage.completion_tokens == 5
    by_ids = api.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 4


def test_streaming_with_usage_matches_the_blocking_answer(gateway: Gateway) -> None:
    api = client(gateway)
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


def test_streaming_completions(gateway: Gateway) -> None:
    chunks = list(client(gateway).completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, stream=True))  # fmt: skip
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def cached(gateway: Gateway, tenant: str, user: str, messages: list[dict[str, str]]) -> int:
    response = client(gateway, tenant).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, user=user
    )
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return response.usage.prompt_tokens_details.cached_tokens or 0


def test_public_system_prompt_is_shared_across_tenants_and_nothing_else(gateway: Gateway) -> None:
    def chat(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    cached(gateway, "acme", "alice", chat("What does a date change cost on flight EA 214?"))
    public = cached(gateway, "globex", "gina", chat("Can I bring a bicycle?"))
    plan = gateway.server.gateway.policy.policy.registry
    assert len(plan) == 1
    assert public > 0 and public % 16 == 0
    # Only the public blocks: globex's question shares nothing with acme's.
    assert public == cached(gateway, "initech", "ivan", chat("Is Wi-Fi free on board?"))


def test_private_prefix_stays_with_its_user(gateway: Gateway) -> None:
    conversation = [
        {"role": "user", "content": "My passport number is X1234567 and I fly on Friday. " * 6},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Which terminal?"},
    ]
    assert cached(gateway, "acme", "alice", conversation) == 0
    assert cached(gateway, "globex", "alice", conversation) == 0  # another tenant
    assert cached(gateway, "acme", "bob", conversation) == 0  # another user, user-scoped
    assert cached(gateway, "acme", "alice", conversation) > 0  # the same user again


def test_tenant_wide_sharing_and_the_user_header(gateway: Gateway) -> None:
    conversation = [{"role": "user", "content": "Quarterly travel report for the team. " * 8}]
    assert cached(gateway, "initech", "ivan", conversation) == 0
    assert cached(gateway, "initech", "irene", conversation) > 0  # tenant-scoped
    api = client(gateway, "acme")
    fresh = [{"role": "user", "content": "Header-scoped user message. " * 8}]
    for expected_zero in (True, False):
        response = api.chat.completions.create(
            model=MODEL, messages=fresh, max_tokens=1, temperature=0,
            extra_headers={"X-PrefixGate-User": "carol"},
        )  # fmt: skip
        assert response.usage is not None and response.usage.prompt_tokens_details is not None
        hit = response.usage.prompt_tokens_details.cached_tokens or 0
        assert (hit == 0) == expected_zero


def test_client_cache_salt_and_prompt_cache_key_never_widen_a_scope(gateway: Gateway) -> None:
    conversation = [{"role": "user", "content": "A secret plan about the merger. " * 8}]
    cached(gateway, "acme", "alice", conversation)
    response = client(gateway, "globex").chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=1, temperature=0, user="mallory",
        extra_body={"prompt_cache_key": "acme-alice"},
    )  # fmt: skip
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as raised:
        client(gateway, "globex").chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=1, extra_body={"cache_salt": "x"}
        )
    assert raised.value.body["param"] == "cache_salt"  # type: ignore[index]
