"""Uploads that drip, stall or stop: each costs its own tenant's slot for a bounded time, is
answered 408 (or not at all, if the client left), and is audited once, never as a 500."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tenancy.tenants import TenantLimits
from tests.support.gateway import MODEL, Gateway, start_gateway

DEADLINE_S = 1.5


@pytest.fixture(scope="module")
def uploads(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    state_dir = tmp_path_factory.mktemp("uploads-state")
    tenants = [("acme", "user", TenantLimits(max_concurrent=2))]
    with start_gateway(migrated_template, tiny_chat_dir, state_dir, tenants,
                       body_read_timeout_s=DEADLINE_S) as started:  # fmt: skip
        yield started


def open_upload(gateway: Gateway, declared: int) -> socket.socket:
    """A chat request whose headers promise `declared` body bytes, none sent yet."""
    sock = socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
        f"Authorization: Bearer {gateway.keys['acme']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n".encode()
    )
    return sock


def server_errors(gateway: Gateway) -> float:
    registry = gateway.server.gateway.metrics.registry
    labels = {"endpoint": "chat", "status": "500"}
    return registry.get_sample_value("prefixgate_requests_total", labels) or 0.0


def test_a_dripping_body_is_answered_408_within_the_deadline(uploads: Gateway) -> None:
    before = uploads.last_audit_seq()
    with open_upload(uploads, 100) as sock:
        started = time.monotonic()
        response = b""
        sock.settimeout(0.2)
        while not response and time.monotonic() - started < 10:
            sock.sendall(b" ")  # a byte every 0.2 s: never idle, never done
            with contextlib.suppress(TimeoutError):
                response = sock.recv(65536)
        elapsed = time.monotonic() - started
    assert response.startswith(b"HTTP/1.1 408"), response[:100]
    assert elapsed < DEADLINE_S + 2
    (event,) = uploads.wait_for_audit_events(before, 1)
    assert (event.outcome, event.details["status"]) == ("rejected", 408)


def test_uploads_in_progress_hold_their_tenants_slots(uploads: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {uploads.keys['acme']}"}
    stalled = [open_upload(uploads, 1000) for _ in range(2)]  # the tenant's limit: 2
    try:
        time.sleep(0.3)
        third = httpx.post(uploads.base_url + "/chat/completions", json=body, headers=headers)
        assert third.status_code == 429 and "concurrent" in third.json()["error"]["message"]
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the slots come back when the uploads end
        retry = httpx.post(uploads.base_url + "/chat/completions", json=body, headers=headers)
        if retry.status_code == 200:
            break
        time.sleep(0.1)
    assert retry.status_code == 200


def test_a_client_that_leaves_mid_body_is_cancelled_not_a_500(uploads: Gateway) -> None:
    before, errors = uploads.last_audit_seq(), server_errors(uploads)
    with open_upload(uploads, 1000) as sock:
        sock.sendall(b'{"model": "tiny-')
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while not uploads.audit_events(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = uploads.audit_events(before)
    assert (event.outcome, event.details["status"]) == ("cancelled", 499)
    assert server_errors(uploads) == errors


def test_a_silent_body_is_answered_408_and_audited_as_such(uploads: Gateway) -> None:
    before = uploads.last_audit_seq()
    with open_upload(uploads, 100) as sock:
        sock.settimeout(DEADLINE_S + 5)
        response = sock.recv(65536)  # whichever layer's deadline fires first answers
    assert response.startswith(b"HTTP/1.1 408"), response[:100]
    deadline = time.monotonic() + 5
    while not uploads.audit_events(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = uploads.wait_for_audit_events(before, 1)
    assert (event.outcome, event.details["status"]) == ("rejected", 408)
