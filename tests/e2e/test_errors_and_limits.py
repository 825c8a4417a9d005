"""Every bad input gets the right status and OpenAI's error shape; limits answer 429."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL, Gateway

CHAT_PATH = "/v1/chat/completions"


def post(gateway: Gateway, body: Any, tenant: str | None = "acme", path: str = CHAT_PATH,
         **kwargs: Any) -> httpx.Response:  # fmt: skip
    headers = dict(kwargs.pop("headers", {}))
    if tenant is not None:
        headers["Authorization"] = f"Bearer {gateway.keys[tenant]}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers.setdefault("Content-Type", "application/json")
    kwargs.setdefault("timeout", 60)
    return httpx.post(gateway.server.url + path, content=content, headers=headers, **kwargs)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **fields}  # fmt: skip


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:  # fmt: skip
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


CASES = [
    ("n-two", chat(n=2), 400, "n", None),
    ("unsupported-field", chat(logprobs=True), 400, "logprobs", None),
    ("tools", chat(tools=[]), 400, "tools", None),
    ("temperature", chat(temperature=5), 400, "temperature", None),
    ("top-p", chat(top_p=0), 400, "top_p", None),
    ("max-tokens", chat(max_tokens=0), 400, "max_tokens", None),
    ("no-messages", {"model": MODEL}, 400, "messages", None),
    ("empty-messages", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("bad-role", chat(messages=[{"role": "wizard", "content": "x"}]), 400, None, None),
    ("image", chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                           "image_url": {"url": "x"}}]}]),
     400, None, None),
    ("stream-options-alone", chat(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("unknown-model", chat(model="gpt-9"), 404, "model", "model_not_found"),
    ("too-long", chat(messages=[{"role": "user", "content": "word " * 2000}]), 400, "messages",
     "context_length_exceeded"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), CASES,
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_bad_requests(gateway: Gateway, name: str, body: Any, status: int, param: str | None,
                      code: str | None) -> None:  # fmt: skip
    assert_error(post(gateway, body), status, param, code)


def test_invalid_json_and_wrong_types(gateway: Gateway) -> None:
    assert_error(post(gateway, b"{not json"), 400)
    assert_error(post(gateway, [1, 2]), 400)
    assert_error(post(gateway, {"model": MODEL, "prompt": [1, "x"]}, path="/v1/completions"), 400,
                 "prompt")  # fmt: skip
    assert_error(post(gateway, {"model": MODEL, "prompt": [10**9]}, path="/v1/completions"), 400,
                 "prompt")  # fmt: skip


def test_authentication_failures(gateway: Gateway) -> None:
    assert_error(post(gateway, chat(), tenant=None), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer pgk_zzzzzzzzzzzz_" + "a" * 49}
    assert_error(post(gateway, chat(), tenant=None, headers=bad), 401, code="invalid_api_key")
    assert_error(post(gateway, chat(), tenant="frozen"), 403, code="tenant_suspended")
    response = httpx.get(gateway.server.url + "/v1/models", timeout=10)
    assert_error(response, 401)


def test_body_too_large(gateway: Gateway) -> None:
    huge = chat(messages=[{"role": "user", "content": "x" * 70_000}])
    assert_error(post(gateway, huge), 413, code="request_too_large")


def test_request_rate_limit_sends_retry_after(gateway: Gateway) -> None:
    statuses = [post(gateway, chat(), tenant="tight").status_code for _ in range(4)]
    assert statuses[:3] == [200, 200, 200]
    limited = post(gateway, chat(), tenant="tight")
    error = assert_error(limited, 429, code="rate_limit_exceeded")
    assert int(limited.headers["Retry-After"]) >= 1 and "rate limit" in error["message"]


def test_token_rate_limit(gateway: Gateway) -> None:
    assert post(gateway, chat(max_tokens=50), tenant="thrifty").status_code == 200
    over = post(gateway, chat(max_tokens=400), tenant="thrifty")
    assert_error(over, 429, param="max_tokens", code="tokens_per_minute_exceeded")
    assert over.headers["Retry-After"] == "60"


def test_concurrency_limit_and_disconnect_frees_blocks(gateway: Gateway) -> None:
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


def test_a_non_streaming_client_that_gives_up_frees_its_blocks(gateway: Gateway) -> None:
    state = gateway.server.gateway
    cancelled = state.engine.metrics.cancelled
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and hangs up
        post(gateway, chat(max_tokens=1500, temperature=0), tenant="globex", timeout=0.5)
    deadline = time.monotonic() + 10
    while (state.engine.pool.num_active or state.engine.metrics.cancelled == cancelled) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert state.engine.metrics.cancelled == cancelled + 1
    assert state.engine.pool.num_active == 0


def test_shutting_down_answers_503(gateway: Gateway) -> None:
    state = gateway.server.gateway
    state.draining = True
    try:
        assert_error(post(gateway, chat()), 503, code="shutting_down")
        assert httpx.get(gateway.server.url + "/readyz").status_code == 503
    finally:
        state.draining = False
