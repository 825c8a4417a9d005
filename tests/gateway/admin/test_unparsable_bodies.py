"""A body the admin API cannot parse as JSON gets the answer /v1 gives it: a 400
`invalid_request_error` saying the body is not valid JSON, with or without a credential, never
FastAPI's own "error parsing the body" as a server error."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.support.admin import login
from tests.support.gateway import Gateway

DEPTH = 5_000  # past Python's recursion limit, well inside the body limit
BODIES = {
    "nested 5,000 deep": b'{"slug": ' + b"[" * DEPTH + b"]" * DEPTH + b"}",
    "a 5,000-digit number": b'{"slug": "x", "max_concurrent": ' + b"9" * 5_000 + b"}",
    "not UTF-8": b'{"slug": "\xff\xfe"}',
    "bad syntax": b'{"slug": ',
}


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_a_body_that_is_not_json_is_the_same_400_as_on_v1(gateway: Gateway, body: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    inference = {**headers, "Authorization": f"Bearer {gateway.keys['acme']}"}
    expected = error_of(
        httpx.post(f"{gateway.base_url}/chat/completions", content=body, headers=inference)
    )
    assert expected == {
        "message": "the request body is not valid JSON",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    operator = {**headers, "Authorization": f"Bearer {login(gateway)}"}
    for credential in (headers, operator):
        created = httpx.post(f"{gateway.admin_url}/tenants", content=body, headers=credential)
        assert error_of(created) == expected
        patched = httpx.patch(
            f"{gateway.admin_url}/tenants/{uuid.uuid4()}", content=body, headers=credential
        )
        assert error_of(patched) == expected
