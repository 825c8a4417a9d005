"""/admin/api/audit: search with filters and keyset pages, a download that `prefixgate audit
verify` accepts (and rejects once a byte changed), the chain's status, and a tenant-admin that
reads its own tenant's events and nothing else."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.admin import admin_client, login
from tests.support.cli import Cli
from tests.support.gateway import KEY_SECRET, SIGNING_KEY, Gateway


@pytest.fixture(scope="module")
def admin_token(gateway: Gateway) -> str:
    """One admin session for the module (logins are throttled per address)."""
    return login(gateway)


def _new_tenant(client: httpx.Client) -> tuple[str, str]:
    """A tenant with a few audited changes (one refused); its id and slug."""
    slug = f"a-{uuid.uuid4().hex[:10]}"
    answer = client.post("/tenants", json={"slug": slug, "cache_quota_blocks": 8})
    assert answer.status_code == 201, answer.text
    tenant_id: str = answer.json()["id"]
    assert client.patch(f"/tenants/{tenant_id}", json={"max_concurrent": 3}).status_code == 200
    refused = client.put(f"/tenants/{tenant_id}/quota", json={"reservation_blocks": 9})
    assert refused.status_code == 400
    assert client.put(f"/tenants/{tenant_id}/quota", json={"quota_blocks": 6}).status_code == 200
    return tenant_id, slug


def _tenant_admin_key(client: httpx.Client, tenant_id: str) -> str:
    answer = client.post(f"/tenants/{tenant_id}/keys", json={"name": "ta", "role": "tenant-admin"})
    assert answer.status_code == 201, answer.text
    key: str = answer.json()["key"]
    return key


def _events(client: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    answer = client.get("/audit/events", params={"limit": 500, **params})
    assert answer.status_code == 200, answer.text
    assert answer.json()["next_cursor"] is None
    data: list[dict[str, Any]] = answer.json()["data"]
    return data


def _seqs(events: list[Any]) -> list[int]:
    return [event["seq"] if isinstance(event, dict) else event.seq for event in events]


def _cli(gateway: Gateway, tmp_path: Path) -> Cli:
    """`prefixgate` on the gateway's database with its secrets (the signing key verifies)."""
    cli = Cli(gateway.database_url, tmp_path / "cli-state")
    cli.env["PREFIXGATE_KEY_HASH_SECRET"] = KEY_SECRET
    cli.env["PREFIXGATE_AUDIT_SIGNING_KEY"] = SIGNING_KEY
    return cli


def test_each_filter_combination_returns_exactly_the_matching_events(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id, _ = _new_tenant(client)
        _new_tenant(client)  # another tenant's events must never match
        stored = [event for event in gateway.audit_events() if event.tenant_id == tenant_id]
        newest_first = stored[::-1]
        assert {event.action for event in stored} >= {"tenant.create", "tenant.set_quota"}

        def expect(params: dict[str, Any], keep: Any) -> None:
            found = _events(client, tenant_id=tenant_id, **params)
            assert _seqs(found) == _seqs([e for e in newest_first if keep(e)]), params
            assert found, params  # every case below selects something

        expect({}, lambda e: True)
        expect({"action": "tenant.update"}, lambda e: e.action == "tenant.update")
        expect({"action": "tenant."}, lambda e: e.action.startswith("tenant."))
        expect({"action": "tenant.*"}, lambda e: e.action.startswith("tenant."))
        expect({"outcome": "failure"}, lambda e: e.outcome == "failure")
        expect(
            {"action": "tenant.set_quota", "outcome": "success"},
            lambda e: e.action == "tenant.set_quota" and e.outcome == "success",
        )
        since, until = stored[1].time, stored[-1].time
        expect(
            {"since": since.isoformat(), "until": until.isoformat()},
            lambda e: since <= e.time < until,
        )
        # The same filters without the tenant reach the other tenant's events too.
        everywhere = _events(client, action="tenant.create", since=stored[0].time.isoformat())
        assert len(everywhere) >= 2 and {e["tenant_id"] for e in everywhere} > {tenant_id}
        shown = _events(client, tenant_id=tenant_id, action="tenant.update")[0]
        assert set(shown) == {
            "seq", "event_id", "time", "actor_type", "actor_id", "tenant_id", "action",
            "resource_type", "resource_id", "outcome", "request_id", "source_ip", "details",
        }  # fmt: skip
        assert shown["details"]["after"]["max_concurrent"] == 3


def test_pages_walk_every_event_once_in_either_direction(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id, _ = _new_tenant(client)
        expected = _seqs([e for e in gateway.audit_events() if e.tenant_id == tenant_id])
        # Newest first from the top, or oldest first from after_seq=0.
        for start, order in ({}, expected[::-1]), ({"after_seq": 0}, expected):
            walked: list[int] = []
            params: dict[str, Any] = {"tenant_id": tenant_id, "limit": 2, **start}
            cursor = "after_seq" if start else "before_seq"
            while True:
                page = client.get("/audit/events", params=params).json()
                walked += _seqs(page["data"])
                if page["next_cursor"] is None:
                    break
                params[cursor] = page["next_cursor"]
            assert walked == order, cursor
        both = client.get("/audit/events", params={"before_seq": 9, "after_seq": 1})
        assert both.status_code == 400


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"since": "2026-01-01T00:00:00"}, "since"),  # no time zone
        ({"until": "yesterday"}, "until"),
        ({"limit": 501}, "limit"),
        ({"tenant_id": "acme"}, "tenant_id"),
    ],
)
def test_bad_filters_are_400s_that_name_the_parameter(
    gateway: Gateway, admin_token: str, params: dict[str, Any], param: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        answer = client.get("/audit/events", params=params)
        assert answer.status_code == 400, answer.text
        assert param in answer.json()["error"]["message"]
        assert client.get("/audit/export", params={"format": "xml"}).status_code == 400


def test_a_filtered_download_verifies_and_a_flipped_byte_does_not(
    gateway: Gateway, admin_token: str, tmp_path: Path
) -> None:
    cli = _cli(gateway, tmp_path)
    with admin_client(gateway, admin_token) as client:
        tenant_id, slug = _new_tenant(client)
        filters = {"tenant_id": tenant_id, "action": "tenant.*"}
        searched = sorted(_seqs(_events(client, **filters)))
        for file_format in ("jsonl", "csv"):
            answer = client.get("/audit/export", params={**filters, "format": file_format})
            assert answer.status_code == 200, answer.text
            disposition = answer.headers["content-disposition"]
            assert disposition.startswith("attachment; filename=")
            assert disposition.endswith(f'.{file_format}"')
            download = tmp_path / f"audit.{file_format}"
            download.write_bytes(answer.content)
            verdict = cli.ok("audit", "verify", str(download))
            assert verdict.startswith(f"ok: {len(searched)} events verified"), verdict
            flipped = answer.content.replace(slug.encode(), slug[:-1].encode() + b"!", 1)
            assert len(flipped) == len(answer.content) and flipped != answer.content
            download.write_bytes(flipped)
            assert "FAILED" in cli.error("audit", "verify", str(download), code=1)
        lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_bytes().splitlines()]
        events = [line for line in lines if line["record"] == "event"]
        assert [event["seq"] for event in events] == searched
        assert lines[0]["filter"]["action"] == "tenant.*"
    exports = [e for e in gateway.audit_events() if e.action == "audit.export"]
    assert exports[-1].details["events"] == len(searched)
    assert exports[-1].details["tenant_id"] == tenant_id and exports[-1].outcome == "success"


def test_a_tenant_admin_reads_only_its_own_tenants_events(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        own_id, _ = _new_tenant(client)
        other_id, _ = _new_tenant(client)
        key = _tenant_admin_key(client, own_id)
    global_events = [e for e in gateway.audit_events() if e.tenant_id is None]
    assert global_events  # logins and the like: an admin sees them, a tenant-admin never
    with admin_client(gateway, key) as own:
        seen = _events(own)
        assert seen and {event["tenant_id"] for event in seen} == {own_id}
        assert _seqs(seen) == _seqs(_events(own, tenant_id=own_id))
        for path in ("/audit/events", "/audit/export"):
            refused = own.get(path, params={"tenant_id": other_id})
            assert refused.status_code == 404, path
            assert refused.json()["error"]["code"] == "not_found"
        assert own.get("/audit/events", params={"tenant_id": str(uuid.uuid4())}).status_code == 404
        download = own.get("/audit/export")
        assert download.status_code == 200
        records = [json.loads(line) for line in download.content.splitlines()]
        events = [record for record in records if record["record"] == "event"]
        assert events and {event["tenant_id"] for event in events} == {own_id}
        assert records[-1]["filter"]["tenant_id"] == own_id
        assert own.get("/audit/verification").status_code == 403


def test_the_chain_status_is_verified_and_reused_for_a_few_seconds(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        first = client.get("/audit/verification")
        assert first.status_code == 200, first.text
        status = first.json()
        assert status["ok"] is True and status["problem"] is None, status
        assert status["events"] >= 1
        assert status["last_checkpoint_seq"] is None or status["last_checkpoint_seq"] >= 1
        again = client.get("/audit/verification").json()
        assert again["checked_at"] == status["checked_at"]  # not checked twice in a row


def test_the_export_range_filters_by_time(gateway: Gateway, admin_token: str) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id, _ = _new_tenant(client)
        stored = [e for e in gateway.audit_events() if e.tenant_id == tenant_id]
        later = (stored[-1].time + timedelta(seconds=1)).isoformat()
        answer = client.get("/audit/export", params={"tenant_id": tenant_id, "since": later})
        assert answer.status_code == 200
        records = [json.loads(line) for line in answer.content.splitlines()]
        assert [record["record"] for record in records] == ["header", "trailer"]
        assert records[-1]["count"] == 0
