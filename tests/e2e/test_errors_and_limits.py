"""Errors and limits every route shares, in OpenAI's error shape: bodies that are not JSON,
keys that fail, bodies too large, a tenant's limits (429 with Retry-After), clients that leave,
and a gateway shutting down."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.gateway import MODEL, Gateway
from tests.support.openai_errors import assert_error, chat, post


def test_a_body_that_is_not_a_json_object_or_has_a_wrongly_typed_prompt_is_a_400(
    gateway: Gateway,
) -> None:
    assert_error(post(gateway, b"{not json"), 400)
    assert_error(post(gateway, [1, 2]), 400)
    assert_error(post(gateway, {"model": MODEL, "prompt": [1, "x"]}, path="/v1/completions"), 400,
                 "prompt")  # fmt: skip
    assert_error(post(gateway, {"model": MODEL, "prompt": [10**9]}, path="/v1/completions"), 400,
                 "prompt")  # fmt: skip


def test_a_missing_or_unknown_key_is_401_and_a_suspended_tenant_403(gateway: Gateway) -> None:
    assert_error(post(gateway, chat(), tenant=None), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer pgk_zzzzzzzzzzzz_" + "a" * 49}
    assert_error(post(gateway, chat(), tenant=None, headers=bad), 401, code="invalid_api_key")
    assert_error(post(gateway, chat(), tenant="frozen"), 403, code="tenant_suspended")
    response = httpx.get(gateway.server.url + "/v1/models", timeout=10)
    assert_error(response, 401)


def test_a_body_past_the_size_limit_is_413(gateway: Gateway) -> None:
    huge = chat(messages=[{"role": "user", "content": "x" * 70_000}])
    assert_error(post(gateway, huge), 413, code="request_too_large")


def test_a_tenant_past_its_request_rate_gets_429_with_retry_after(gateway: Gateway) -> None:
    statuses = [post(gateway, chat(), tenant="tight").status_code for _ in range(4)]
    assert statuses[:3] == [200, 200, 200]
    limited = post(gateway, chat(), tenant="tight")
    error = assert_error(limited, 429, code="rate_limit_exceeded")
    assert int(limited.headers["Retry-After"]) >= 1 and "rate limit" in error["message"]


def test_a_tenant_past_its_token_rate_gets_429_naming_max_tokens(gateway: Gateway) -> None:
    assert post(gateway, chat(max_tokens=50), tenant="thrifty").status_code == 200
    over = post(gateway, chat(max_tokens=400), tenant="thrifty")
    assert_error(over, 429, param="max_tokens", code="tokens_per_minute_exceeded")
    assert over.headers["Retry-After"] == "60"


def test_a_request_past_the_concurrency_limit_is_429_and_a_disconnect_frees_blocks_and_slot(
    gateway: Gateway,
) -> None:
    body = chat(max_tokens=1500, stream=True, temperature=0)
    state = gateway.server.gateway
    opened, leave = threading.Event(), threading.Event()

    def hold_a_stream_open() -> None:
        with httpx.stream("POST", gateway.server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {gateway.keys['solo']}"},
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200
            for _ in response.iter_lines():
                opened.set()
                if leave.wait(0.01):
                    break  # closing the response drops the connection mid-stream

    worker = threading.Thread(target=hold_a_stream_open)
    worker.start()
    try:
        assert opened.wait(30)
        assert state.engine.pool.num_active > 0
        second = post(gateway, chat(), tenant="solo")
        assert_error(second, 429, code="rate_limit_exceeded")
        assert "concurrent" in second.json()["error"]["message"]
    finally:
        leave.set()
        worker.join(30)
    deadline = time.monotonic() + 10
    while state.engine.pool.num_active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state.engine.pool.num_active == 0  # the disconnect freed the request's blocks
    assert state.engine.metrics.cancelled >= 1
    while post(gateway, chat(), tenant="solo").status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)  # the limiter slot is released when the stream's task ends
    assert post(gateway, chat(), tenant="solo").status_code == 200


def test_each_choice_counts_against_the_tenants_concurrency(gateway: Gateway) -> None:
    # One tenant's n choices run as n sequences: n=8 from 16 requests would be 128.
    refused = post(gateway, chat(n=2), tenant="solo")  # at most 1 at a time, ever
    assert "concurrent" in assert_error(refused, 400, "n")["message"]
    body = chat(max_tokens=1500, stream=True, temperature=1.0, n=8)
    opened, leave = threading.Barrier(3), threading.Event()

    def hold_eight_slots() -> None:
        with httpx.stream("POST", gateway.server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {gateway.keys['globex']}"},
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)
            opened.wait(30)
            leave.wait(30)

    workers = [threading.Thread(target=hold_eight_slots) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        opened.wait(30)  # 16 of globex's 16 slots are taken
        third = post(gateway, chat(), tenant="globex")
        assert "concurrent" in assert_error(third, 429, code="rate_limit_exceeded")["message"]
    finally:
        leave.set()
        for worker in workers:
            worker.join(30)
    deadline = time.monotonic() + 10
    while post(gateway, chat(), tenant="globex").status_code == 429:
        assert time.monotonic() < deadline, "the slots came back"
        time.sleep(0.05)


def test_a_non_streaming_client_that_gives_up_frees_its_blocks_and_is_audited_499(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    state = gateway.server.gateway
    cancelled = state.engine.metrics.cancelled
    after = gateway.last_audit_seq()
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and hangs up
        post(gateway, chat(max_tokens=1500, temperature=0), tenant="globex", timeout=0.5)
    deadline = time.monotonic() + 10
    while (state.engine.pool.num_active or state.engine.metrics.cancelled == cancelled) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert state.engine.metrics.cancelled == cancelled + 1
    assert state.engine.pool.num_active == 0
    (event,) = gateway.wait_for_audit_events(after, 1)
    assert (event.outcome, event.details["status"]) == ("cancelled", 499)
    # A client leaving is no error of the server's: nothing is logged with a traceback.
    assert not [record for record in caplog.records if record.exc_info]


def test_a_draining_gateway_answers_503_and_is_not_ready(gateway: Gateway) -> None:
    state = gateway.server.gateway
    state.draining = True
    try:
        assert_error(post(gateway, chat()), 503, code="shutting_down")
        assert httpx.get(gateway.server.url + "/readyz").status_code == 503
    finally:
        state.draining = False
