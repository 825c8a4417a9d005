"""Everything an attacker with one valid key can send: each bad input is a clear error in
OpenAI's shape, leaves exactly one audit event, and the server stays healthy for everyone."""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any

import httpx
import pytest

from tenancy import api_keys, tenants
from tenancy.tenants import TenantLimits
from tests.support.gateway import KEY_SECRET, MODEL, Gateway
from tests.support.raw_http import exchange

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
VOCAB = 49152  # the tiny model's vocabulary (SmolLM2's tokenizer)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **fields}  # fmt: skip


def completion(prompt: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2}


# name, path, body (dict or raw bytes), tenant (None: no key), status, param, code
CASES: list[tuple[str, str, Any, str | None, int, str | None, str | None]] = [
    ("tiny-temperature", CHAT, chat(temperature=1e-300), "acme", 400, "temperature", None),
    ("tiny-top-p", CHAT, chat(top_p=1e-300), "acme", 400, "top_p", None),
    ("seed-too-big", CHAT, chat(seed=2**64), "acme", 400, "seed", None),
    ("seed-too-small", CHAT, chat(seed=-(2**63) - 1), "acme", 400, "seed", None),
    ("negative-token-ids", COMPLETIONS, completion([-1] * 16), "acme", 400, "prompt", None),
    ("token-id-past-vocab", COMPLETIONS, completion([VOCAB]), "acme", 400, "prompt", None),
    ("token-id-past-32-bits", COMPLETIONS, completion([2**32]), "acme", 400, "prompt", None),
    ("empty-token-ids", COMPLETIONS, completion([]), "acme", 400, "prompt", None),
    ("lone-surrogate-content", CHAT, chat(messages=[{"role": "user", "content": "a\udfffb"}]),
     "acme", 400, "messages", None),
    ("lone-surrogate-user", CHAT, chat(user="\ud800"), "acme", 400, "user", None),
    ("lone-surrogate-prompt", COMPLETIONS, completion("x\udfff"), "acme", 400, "prompt", None),
    ("max-tokens-as-string", CHAT, chat(max_tokens="5"), "acme", 400, "max_tokens", None),
    ("stream-as-string", CHAT, chat(stream="yes"), "acme", 400, "stream", None),
    ("temperature-as-string", CHAT, chat(temperature="0.5"), "acme", 400, "temperature", None),
    ("n-as-float", CHAT, chat(n=1.0), "acme", 400, "n", None),
    ("too-many-messages", CHAT, chat(messages=[{"role": "user", "content": ""}] * 257), "acme",
     400, "messages", None),
    ("too-many-characters", CHAT, chat(messages=[{"role": "user", "content": "x" * 30_000}]),
     "acme", 400, "messages", "context_length_exceeded"),
    ("can-never-fit-the-quota", CHAT, chat(max_tokens=200), "cramped", 400, None,
     "cache_quota_too_small"),
    ("unsupported-parameter", CHAT, chat(functions=[]), "acme", 400, "functions", None),
    ("not-json", CHAT, b"{not json", "acme", 400, None, None),
    ("no-body", CHAT, b"", "acme", 400, None, None),
    ("body-too-large", CHAT, chat(messages=[{"role": "user", "content": "x" * 70_000}]), "acme",
     413, None, "request_too_large"),
    ("no-key", CHAT, chat(), None, 401, None, "invalid_api_key"),
    ("suspended-tenant", CHAT, chat(), "frozen", 403, None, "tenant_suspended"),
    ("unknown-route", "/v1/nope", chat(), "acme", 404, None, None),
]  # fmt: skip


def send(gateway: Gateway, path: str, body: Any, tenant: str | None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if tenant is not None:
        headers["Authorization"] = f"Bearer {gateway.keys[tenant]}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(gateway.server.url + path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("name", "path", "body", "tenant", "status", "param", "code"), CASES,
    ids=[case[0] for case in CASES],
)  # fmt: skip
def test_a_bad_input_is_one_clear_error_and_one_audit_event(
    gateway: Gateway, name: str, path: str, body: Any, tenant: str | None, status: int,
    param: str | None, code: str | None,
) -> None:  # fmt: skip
    before = gateway.last_audit_seq()
    response = send(gateway, path, body, tenant)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    events = gateway.audit_events(before)
    assert len(events) == 1, [(e.action, e.outcome) for e in events]
    assert events[0].outcome in ("rejected", "failure")
    assert events[0].details["status"] == status
    assert httpx.get(gateway.server.url + "/healthz", timeout=5).status_code == 200


def test_a_request_that_can_never_fit_says_why_in_the_tenants_terms(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    response = send(gateway, CHAT, chat(max_tokens=200), "cramped")
    message = response.json()["error"]["message"]
    assert "cramped" in message and "64" in message  # its quota: 4 blocks of 16 tokens
    assert "Retry-After" not in response.headers  # retrying can never help
    (event,) = gateway.audit_events(before)
    assert event.tenant_id is not None and event.tenant_id not in message


def test_models_and_successes_are_audited_once_each(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    assert httpx.get(gateway.server.url + "/v1/models", headers=headers).status_code == 200
    assert send(gateway, CHAT, chat(), "acme").status_code == 200
    events = gateway.audit_events(before)
    assert [(e.action, e.outcome) for e in events] == [
        ("models.list", "success"),
        ("inference.chat", "success"),
    ]


def test_forwarded_for_is_ignored_without_trusted_proxies(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}", "X-Forwarded-For": "6.6.6.6"}
    httpx.post(gateway.server.url + CHAT, json=chat(), headers=headers, timeout=60)
    (event,) = gateway.audit_events(before)
    assert event.source_ip == "127.0.0.1"


def test_the_connection_stays_usable_after_a_500(gateway: Gateway) -> None:
    served = gateway.server.gateway.models.get(MODEL)
    assert served is not None
    policy = served.sharing.current

    def broken_plan(*_: Any, **__: Any) -> Any:
        raise RuntimeError("an injected fault in the policy")

    payload = json.dumps(chat()).encode()
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {gateway.keys['acme']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    before = gateway.last_audit_seq()
    policy.plan = broken_plan  # type: ignore[method-assign]
    try:
        with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=30) as sock:
            head = exchange(sock, request)
            assert head.startswith(b"HTTP/1.1 500"), head
            assert b"connection: close" not in head.lower()
            health = exchange(sock, b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
            assert health.startswith(b"HTTP/1.1 200"), health
    finally:
        del policy.plan
    (event,) = gateway.audit_events(before)
    assert (event.outcome, event.details["status"]) == ("failure", 500)


def test_a_request_refused_while_shutting_down_is_audited_once(gateway: Gateway) -> None:
    state = gateway.server.gateway
    before = gateway.last_audit_seq()
    state.draining = True
    try:
        assert send(gateway, CHAT, chat(), "acme").status_code == 503
    finally:
        state.draining = False
    (event,) = gateway.audit_events(before)
    assert (event.action, event.outcome, event.details["status"]) == ("inference.chat",
                                                                      "failure", 503)  # fmt: skip


def test_absurdly_deep_json_is_a_400(gateway: Gateway) -> None:
    depth = 30_000  # far past Python's recursion limit, well inside the body limit
    body = b'{"model": "tiny-chat", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    response = send(gateway, CHAT, body, "acme")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "prompt", [[-1], [2**32], [True], [1.0]], ids=["negative", "32-bit", "bool", "float"]
)
def test_a_bad_token_id_is_named_by_its_position_in_plain_words(
    gateway: Gateway, prompt: Any
) -> None:
    error = send(gateway, COMPLETIONS, completion(prompt), "acme").json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt.0: ")
    assert "[" not in error["message"] and "function" not in error["message"]


def test_a_small_quota_gets_a_default_max_tokens_that_fits(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens
    response = send(gateway, CHAT, body, "cramped")
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 4 * 16 + 1


def test_the_audit_event_names_the_model_asked_for(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    assert send(gateway, CHAT, chat(model="gpt-9"), "acme").status_code == 404
    assert send(gateway, "/v1/nope", chat(), "acme").status_code == 404
    missing_model, unknown_route = gateway.audit_events(before)
    assert (missing_model.resource_type, missing_model.resource_id) == ("model", "gpt-9")
    assert (unknown_route.resource_type, unknown_route.resource_id) == ("endpoint", "/v1/nope")


def test_a_small_token_rate_gets_a_default_max_tokens_that_fits(gateway: Gateway) -> None:
    with gateway.server.gateway.store.transaction() as session:  # a bucket no test has used
        limits = TenantLimits(tokens_per_minute=300)
        tenant = tenants.create_tenant(session, f"frugal-{uuid.uuid4().hex[:8]}", limits=limits)
        key = api_keys.create_key(session, tenant, "k", KEY_SECRET).secret
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(gateway.server.url + CHAT, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text


def test_a_body_refused_before_it_is_read_closes_the_connection(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {gateway.keys['acme']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10**7}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=30) as sock:
        head = exchange(sock, request)
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    (event,) = gateway.audit_events(before)
    assert (event.details["status"], event.details["error"]) == (413, "request_too_large")
