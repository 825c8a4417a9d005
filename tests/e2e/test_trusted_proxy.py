"""Behind a trusted proxy: its X-Forwarded-For names the client in the audit log, bounded to
the column, and an absurd header never stalls the audit events after it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tenancy.tenants import TenantLimits
from tests.support.gateway import MODEL, Gateway, start_gateway


@pytest.fixture(scope="module")
def proxied(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    state_dir = tmp_path_factory.mktemp("proxied-state")
    with start_gateway(migrated_template, tiny_chat_dir, state_dir,
                       [("acme", "user", TenantLimits())],
                       trusted_proxies=["127.0.0.1"]) as started:  # fmt: skip
        yield started


def chat(gateway: Gateway, forwarded_for: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}",
               "X-Forwarded-For": forwarded_for}  # fmt: skip
    return httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def test_a_trusted_proxy_names_the_client(proxied: Gateway) -> None:
    before = proxied.last_audit_seq()
    assert chat(proxied, "203.0.113.7").status_code == 200
    (event,) = proxied.audit_events(before)
    assert event.source_ip == "203.0.113.7"


def test_a_100_character_forwarded_for_is_bounded_and_stalls_nothing(proxied: Gateway) -> None:
    before = proxied.last_audit_seq()
    assert chat(proxied, "9" * 100).status_code == 200
    assert chat(proxied, "198.51.100.1").status_code == 200
    events = proxied.audit_events(before)
    assert len(events) == 2  # both in the database: nothing spooled behind the long one
    assert events[0].source_ip is not None and len(events[0].source_ip) == 64
    assert "source_ip" in events[0].details["truncated"]
    assert events[1].source_ip == "198.51.100.1"
    assert proxied.server.gateway.store.audit.pending() == 0
