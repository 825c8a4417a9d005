"""End users inside a tenant: a client-supplied id cannot claim an API key's private scope,
and a header set by a proxy wins over the body's `user`."""

from __future__ import annotations

import uuid

import httpx

from tenancy import api_keys, tenants
from tests.support.gateway import KEY_SECRET, MODEL, Gateway


def cached_tokens(gateway: Gateway, key: str, prompt: str, user: str | None = None,
                  header_user: str | None = None) -> int:  # fmt: skip
    body: dict[str, object] = {"model": MODEL, "max_tokens": 1,
                               "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    if user is not None:
        body["user"] = user
    headers = {"Authorization": f"Bearer {key}"}
    if header_user is not None:
        headers["X-PrefixGate-User"] = header_user
    response = httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers,
                          timeout=60)  # fmt: skip
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def long_prompt() -> str:
    return f"{uuid.uuid4()} " + "a private conversation about the quarterly numbers " * 6


def test_another_key_cannot_claim_a_keys_private_scope(gateway: Gateway) -> None:
    with gateway.server.gateway.store.transaction() as session:
        acme = tenants.get_tenant(session, "acme")
        intruder = api_keys.create_key(session, acme, "intruder", KEY_SECRET).secret
        owners = [api_keys.create_key(session, acme, "owner", KEY_SECRET).secret for _ in "ab"]
    for owner, how in zip(owners, ("user", "header_user"), strict=True):
        prompt = long_prompt()
        cached_tokens(gateway, owner, prompt)
        assert cached_tokens(gateway, owner, prompt) > 0  # the key's own scope is warm
        claim = {how: f"key:{owner.split('_')[1]}"}
        assert cached_tokens(gateway, intruder, prompt, **claim) == 0


def test_a_proxy_header_wins_over_the_body_user(gateway: Gateway) -> None:
    key, prompt = gateway.keys["acme"], long_prompt()
    alice, bob, mallory = (f"{name}-{uuid.uuid4()}" for name in ("alice", "bob", "mallory"))
    cached_tokens(gateway, key, prompt, header_user=alice)
    assert cached_tokens(gateway, key, prompt, user=mallory, header_user=alice) > 0
    assert cached_tokens(gateway, key, prompt, user=alice, header_user=bob) == 0
    assert cached_tokens(gateway, key, prompt, user=alice) > 0  # no proxy: the body's user


def test_a_bad_user_header_is_a_400_that_names_the_header(gateway: Gateway) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for bad in ("u" * 257, "tab\there"):
        response = httpx.post(
            gateway.base_url + "/chat/completions", json=body, timeout=60,
            headers={"Authorization": f"Bearer {gateway.keys['acme']}", "X-PrefixGate-User": bad},
        )  # fmt: skip
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "X-PrefixGate-User" and "X-PrefixGate-User" in error["message"]
