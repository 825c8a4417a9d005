"""Raw requests to the session gateway and the check that an answer is OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.gateway import MODEL, Gateway

CHAT_PATH = "/v1/chat/completions"


def post(gateway: Gateway, body: Any, tenant: str | None = "acme", path: str = CHAT_PATH,
         **kwargs: Any) -> httpx.Response:  # fmt: skip
    """POST `body` (a JSON value, or bytes sent as they are) with `tenant`'s key, or none."""
    headers = dict(kwargs.pop("headers", {}))
    if tenant is not None:
        headers["Authorization"] = f"Bearer {gateway.keys[tenant]}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers.setdefault("Content-Type", "application/json")
    kwargs.setdefault("timeout", 60)
    return httpx.post(gateway.server.url + path, content=content, headers=headers, **kwargs)


def chat(**fields: Any) -> dict[str, Any]:
    """A valid two-token chat request, with `fields` added or replaced."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **fields}  # fmt: skip


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The response has this status and OpenAI's error object (and this param and code)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)
