"""Clients for the admin API of a test gateway: log in, then call it as an admin, a
tenant-admin operator or a tenant-admin key."""

from __future__ import annotations

import httpx

from tests.support.gateway import ADMIN_PASSWORD, ADMIN_USER, Gateway


def login(gateway: Gateway, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> str:
    """A fresh session token for the operator (asserting that the login succeeded)."""
    answer = httpx.post(
        f"{gateway.admin_url}/login", json={"username": username, "password": password}
    )
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["token"]
    return token


def admin_client(gateway: Gateway, credential: str | None = None) -> httpx.Client:
    """An httpx client on /admin/api with `credential` (default: a new admin session)."""
    credential = credential or login(gateway)
    return httpx.Client(
        base_url=gateway.admin_url,
        headers={"Authorization": f"Bearer {credential}"},
        timeout=30,
    )
