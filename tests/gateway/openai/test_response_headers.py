"""OpenAI's response headers: `x-request-id` on every response (the id the audit event keeps),
`openai-processing-ms`, and the tenant's rate-limit state on inference responses; a client's
`X-Client-Request-Id` lands in the audit event."""

from __future__ import annotations

import re

import httpx

from tenancy.tenants import TenantLimits
from tests.support.gateway import MODEL, Gateway, openai_client
from tests.support.openai_errors import assert_error, chat, post

RESET = re.compile(r"^(\d+m)?\d+(\.\d+)?s$")
DEFAULTS = TenantLimits()


def assert_rate_limit_headers(headers: httpx.Headers, limits: TenantLimits = DEFAULTS) -> None:
    for name, limit in (("requests", limits.requests_per_minute),
                        ("tokens", limits.tokens_per_minute)):  # fmt: skip
        assert headers[f"x-ratelimit-limit-{name}"] == str(limit)
        assert 0 <= int(headers[f"x-ratelimit-remaining-{name}"]) <= limit
        assert RESET.match(headers[f"x-ratelimit-reset-{name}"]), headers


def test_a_completion_carries_its_id_timing_and_rate_limits(gateway: Gateway) -> None:
    raw = openai_client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id  # what the audit event records
    assert completion._request_id == completion.id  # the openai client reads it
    assert int(raw.headers["openai-processing-ms"]) >= 0
    assert_rate_limit_headers(raw.headers)


def test_the_headers_show_what_a_request_took_from_a_small_budget(gateway: Gateway) -> None:
    thrifty = TenantLimits(tokens_per_minute=300)  # the session's "thrifty" tenant
    raw = openai_client(gateway, "thrifty").chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert_rate_limit_headers(raw.headers, thrifty)
    # The tokens this request may cost were taken: the bucket refills 5 a second.
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 300
    assert raw.headers["x-ratelimit-reset-tokens"] != "0s"


def test_a_stream_carries_the_same_id_as_its_chunks(gateway: Gateway) -> None:
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=chat(stream=True),
                      headers={"Authorization": f"Bearer {gateway.keys['acme']}"},
                      timeout=60) as response:  # fmt: skip
        body = response.read().decode()
    chunk_id = re.search(r'"id":\s*"([^"]+)"', body)
    assert chunk_id and response.headers["x-request-id"] == chunk_id.group(1)
    assert_rate_limit_headers(response.headers)


def test_errors_and_other_routes_have_a_request_id_too(gateway: Gateway) -> None:
    refused = post(gateway, chat(temperature=9))
    assert_error(refused, 400, "temperature")
    assert refused.headers["x-request-id"].startswith("req_")
    assert_rate_limit_headers(refused.headers)  # an inference request, refused
    no_key = post(gateway, chat(), tenant=None)
    assert no_key.status_code == 401 and no_key.headers["x-request-id"].startswith("req_")
    assert "x-ratelimit-limit-requests" not in no_key.headers  # no tenant to speak of
    health = httpx.get(f"{gateway.server.url}/healthz", timeout=10)
    assert health.headers["x-request-id"].startswith("req_")
    ids = {refused.headers["x-request-id"], no_key.headers["x-request-id"],
           health.headers["x-request-id"]}  # fmt: skip
    assert len(ids) == 3


def test_the_clients_request_id_is_kept_in_the_audit_event(gateway: Gateway) -> None:
    before = gateway.last_audit_seq()
    answer = post(gateway, chat(), headers={"X-Client-Request-Id": "trace-42/attempt-1"})
    assert answer.status_code == 200, answer.text
    events = gateway.wait_for_audit_events(before, 1)
    ours = [event for event in events if event.request_id == answer.headers["x-request-id"]]
    assert len(ours) == 1 and ours[0].details["client_request_id"] == "trace-42/attempt-1"
    for bad in ("x" * 513, "tab\there", ""):
        refused = post(gateway, chat(), headers={"X-Client-Request-Id": bad})
        assert_error(refused, 400, "X-Client-Request-Id")
