"""A credential or identity header sent twice is a 400 naming it, on every route that reads
it: neither the first nor the last copy is believed."""

from __future__ import annotations

import httpx

from tests.support.admin import login
from tests.support.gateway import METRICS_TOKEN, Gateway
from tests.support.openai_errors import CHAT_PATH, assert_error, chat, post


def test_two_authorization_headers_on_the_api_are_a_400(gateway: Gateway) -> None:
    valid = f"Bearer {gateway.keys['acme']}"
    for pair in ([valid, valid], [valid, "Bearer nope"], ["Bearer nope", valid]):
        answer = httpx.post(
            gateway.server.url + CHAT_PATH,
            json=chat(),
            headers=[("Authorization", pair[0]), ("Authorization", pair[1])],
            timeout=60,
        )
        assert_error(answer, 400, "Authorization", "duplicate_header")
    listed = httpx.get(
        gateway.base_url + "/models", headers=[("Authorization", valid), ("Authorization", valid)]
    )
    assert_error(listed, 400, "Authorization", "duplicate_header")


def test_two_end_user_headers_are_a_400(gateway: Gateway) -> None:
    twice = [("X-PrefixGate-User", "alice"), ("x-prefixgate-user", "bob")]
    answer = post(gateway, chat(), headers=twice)
    assert_error(answer, 400, "X-PrefixGate-User", "duplicate_header")
    once = post(gateway, chat(), headers={"X-PrefixGate-User": "alice"})
    assert once.status_code == 200, once.text


def test_two_authorization_headers_on_the_admin_api_are_a_400(gateway: Gateway) -> None:
    token = f"Bearer {login(gateway)}"
    alone = httpx.get(gateway.admin_url + "/tenants", headers={"Authorization": token})
    assert alone.status_code == 200, alone.text
    for pair in ([token, token], [token, f"Bearer {gateway.tenant_admin_keys['acme']}"]):
        answer = httpx.get(
            gateway.admin_url + "/tenants",
            headers=[("Authorization", pair[0]), ("Authorization", pair[1])],
        )
        assert_error(answer, 400, "Authorization", "duplicate_header")


def test_two_authorization_headers_on_the_scraper_routes_are_a_400(gateway: Gateway) -> None:
    token = f"Bearer {METRICS_TOKEN}"
    for path in ("/metrics", "/readyz"):
        answer = httpx.get(
            gateway.server.url + path, headers=[("Authorization", token), ("Authorization", token)]
        )
        assert_error(answer, 400, "Authorization", "duplicate_header")
