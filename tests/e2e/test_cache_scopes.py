"""Which cached prefix a request may reuse, seen through the official `openai` client: the
registered system prompt across tenants, a tenant-scoped tenant's blocks across its users, a
user's own blocks; nothing a client sends widens a scope."""

from __future__ import annotations

import openai
import pytest

from tests.support.gateway import MODEL, SYSTEM_PROMPT, Gateway, openai_client


def cached(gateway: Gateway, tenant: str, user: str, messages: list[dict[str, str]]) -> int:
    response = openai_client(gateway, tenant).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, user=user
    )
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return response.usage.prompt_tokens_details.cached_tokens or 0


def test_public_system_prompt_is_shared_across_tenants_and_nothing_else(gateway: Gateway) -> None:
    def chat(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    cached(gateway, "acme", "alice", chat("What does a date change cost on flight EA 214?"))
    public = cached(gateway, "globex", "gina", chat("Can I bring a bicycle?"))
    served = gateway.server.gateway.models.get(MODEL)
    assert served is not None
    plan = served.sharing.current.registry
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


def test_a_tenant_scoped_tenant_shares_across_users_and_a_header_user_reuses_its_own(
    gateway: Gateway,
) -> None:
    conversation = [{"role": "user", "content": "Quarterly travel report for the team. " * 8}]
    assert cached(gateway, "initech", "ivan", conversation) == 0
    assert cached(gateway, "initech", "irene", conversation) > 0  # tenant-scoped
    api = openai_client(gateway, "acme")
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
    response = openai_client(gateway, "globex").chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=1, temperature=0, user="mallory",
        extra_body={"prompt_cache_key": "acme-alice"},
    )  # fmt: skip
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(gateway, "globex").chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=1, extra_body={"cache_salt": "x"}
        )
    assert raised.value.body["param"] == "cache_salt"  # type: ignore[index]
