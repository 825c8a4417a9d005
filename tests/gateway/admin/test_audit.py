"""/admin/api/audit: search with filters and keyset pages, a download that `prefixgate audit
verify` accepts (and rejects once a byte changed), the chain's status, a tenant-admin that
reads its own tenant's events and nothing else, and exports bounded in number: past the
slots a 429 at once, with nothing written."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.local_server import serve
from gateway.admin import export_slots
from gateway.admin.callers import AdminCaller
from gateway.admin.service import audit_downloads as audit_api
from tenancy import api_keys, tenants
from tenancy.audit_chain import AuditRecord
from tenancy.audit_verification import verify_file
from tenancy.migrate import upgrade
from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.admin import admin_client, login
from tests.support.cli import Cli
from tests.support.gateway import JWT_SECRET, KEY_SECRET, SIGNING_KEY, Gateway


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
        ({"since": "0001-01-01T00:00:00+14:00"}, "since"),  # the year 0 in UTC
        ({"until": "9999-12-31T23:00:00-14:00"}, "until"),  # the year 10000 in UTC
    ],
)
def test_bad_filters_are_400s_that_name_the_parameter(
    gateway: Gateway, admin_token: str, params: dict[str, Any], param: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        answer = client.get("/audit/events", params=params)
        assert answer.status_code == 400, answer.text
        assert param in answer.json()["error"]["message"]
        if param != "limit":  # the export takes the same filters
            exported = client.get("/audit/export", params=params)
            assert exported.status_code == 400, exported.text
            assert exported.json()["error"]["param"] == param
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


def _exports_after(gateway: Gateway, seq: int) -> list[AuditEvent]:
    return [event for event in gateway.audit_events(seq) if event.action == "audit.export"]


def _assert_busy(answer: httpx.Response) -> None:
    """A 429 export_busy with Retry-After, and no file (not even a partial one)."""
    assert answer.status_code == 429, answer.text
    assert answer.headers["retry-after"] == str(export_slots.EXPORT_RETRY_AFTER_S)
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "export_busy")
    assert "content-disposition" not in answer.headers


def _verified(download: bytes, tmp_path: Path) -> int:
    """How many events a downloaded export holds, once it verified."""
    path = tmp_path / f"{uuid.uuid4().hex}.export"
    path.write_bytes(download)
    result = verify_file(path, SIGNING_KEY)
    assert result.ok, result.problem
    return result.events


def test_an_export_past_its_slots_is_a_429_at_once_that_writes_nothing(
    gateway: Gateway, admin_token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id, _ = _new_tenant(client)
        key = _tenant_admin_key(client, tenant_id)
    before = gateway.last_audit_seq()
    slots = export_slots.EXPORT_SLOTS
    with admin_client(gateway, admin_token) as admin, admin_client(gateway, key) as own:
        # Both slots of the process are taken: everyone is told to come back.
        with slots.hold("test:first"), slots.hold("test:second"):
            _assert_busy(admin.get("/audit/export", params={"format": "csv"}))
            _assert_busy(own.get("/audit/export"))
        # Another key of the same tenant is exporting: this tenant waits, an admin does not.
        sibling = AdminCaller("tenant-admin", uuid.UUID(tenant_id), "api_key", "another-key")
        with slots.hold(export_slots.export_holder(sibling)):
            refused = own.get("/audit/export")
            _assert_busy(refused)
            assert "an export of yours" in refused.json()["error"]["message"]
            beside = admin.get("/audit/export", params={"tenant_id": tenant_id})
            assert beside.status_code == 200, beside.text
        # A refusal for size is counted before anything is read, and frees its slot too.
        monkeypatch.setattr(audit_api, "MAX_EXPORT_EVENTS", 2)
        too_large = own.get("/audit/export")
        assert too_large.status_code == 400 and "more than 2 events" in too_large.text
        monkeypatch.undo()
        # Refusals left no slot behind: the tenant's own export now goes through.
        mine = own.get("/audit/export")
        assert mine.status_code == 200, mine.text
    # The tenant's events, and then also the admin's export of them and the refusal.
    assert _verified(mine.content, tmp_path) == _verified(beside.content, tmp_path) + 2 > 2
    exports = _exports_after(gateway, before)
    # The busy refusals are not audited; the export refused for its size is.
    assert [(e.outcome, e.actor_type) for e in exports] == [
        ("success", "operator"),
        ("failure", "api_key"),
        ("success", "api_key"),
    ]


@pytest.fixture(scope="module")
def sqlite_gateway(
    tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A gateway on SQLite (the attacked deployment) with two tenants and a tenant-admin key
    each, one of them with enough events that each export takes a while."""
    state_dir = tmp_path_factory.mktemp("sqlite-gateway")
    url = f"sqlite:///{state_dir / 'prefixgate.db'}"
    upgrade(url)
    store = Store.open(url, state_dir / "seed.spool", KEY_SECRET, SIGNING_KEY)
    keys, admin_keys = {}, {}
    with store.transaction() as session:
        for slug in ("busy", "bystander"):
            # The bystander asks as fast as it can for as long as the exports run: its own
            # request rate must not be what stops it.
            limits = tenants.TenantLimits(requests_per_minute=1_000_000)
            tenant = tenants.create_tenant(session, slug, limits=limits)
            keys[slug] = api_keys.create_key(session, tenant, "api", KEY_SECRET).secret
            admin_keys[slug] = api_keys.create_key(
                session, tenant, "admin", KEY_SECRET, role="tenant-admin"
            ).secret
            if slug == "busy":
                busy_id = str(tenant.id)
    store.audit.record_many(
        [
            AuditRecord("api_key", "inference.chat", "success", tenant_id=busy_id)
            for _ in range(BULK_EVENTS)
        ]
    )
    store.close()
    settings = {
        "database_url": url,
        "state_dir": state_dir,
        "key_hash_secret": KEY_SECRET,
        "audit_signing_key": SIGNING_KEY,
        "jwt_secret": JWT_SECRET,
        "model_dir": tiny_chat_dir,
        "kv_cache_bytes": 16 << 20,
    }
    with serve(settings) as server:
        yield Gateway(server, keys, url, admin_keys)


BULK_EVENTS = 6000


def test_concurrent_exports_with_key_creation_on_sqlite_get_200_or_429_never_500(
    sqlite_gateway: Gateway, tmp_path: Path
) -> None:
    """The attack, smaller: one tenant's admin keys export at once while it creates keys;
    every export is whole or refused, every key is created, the other tenant is served."""
    gateway = sqlite_gateway
    before = gateway.last_audit_seq()
    attacker = gateway.tenant_admin_keys["busy"]
    with admin_client(gateway, attacker) as client:
        tenant_id = client.get("/usage").json()["data"][0]["tenant_id"]
        extra_keys = [_tenant_admin_key(client, tenant_id) for _ in range(5)]
    exporters, rounds = [attacker, *extra_keys], 3
    start = threading.Barrier(len(exporters) + 2)
    done = threading.Event()
    exports: list[httpx.Response] = []
    created: list[int] = []
    served: list[int] = []

    def export(key: str) -> None:
        with admin_client(gateway, key) as client:
            start.wait()
            for _ in range(rounds):
                exports.append(client.get("/audit/export", params={"format": "csv"}))

    def create_keys() -> None:
        with admin_client(gateway, attacker) as client:
            start.wait()
            while not done.is_set():
                answer = client.post(f"/tenants/{tenant_id}/keys", json={"name": "spam"})
                created.append(answer.status_code)

    def bystander() -> None:
        key = gateway.keys["bystander"]
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            start.wait()
            while not done.is_set():
                served.append(client.get(f"{gateway.base_url}/models").status_code)

    threads = [threading.Thread(target=export, args=(key,)) for key in exporters]
    background = [threading.Thread(target=create_keys), threading.Thread(target=bystander)]
    for thread in threads + background:
        thread.start()
    for thread in threads:
        thread.join(120)
    done.set()
    for thread in background:
        thread.join(30)

    statuses = sorted(answer.status_code for answer in exports)
    assert len(statuses) == len(exporters) * rounds
    assert set(statuses) == {200, 429}, statuses  # all started together: one at a time
    for answer in exports:
        if answer.status_code == 429:
            _assert_busy(answer)
        else:
            assert _verified(answer.content, tmp_path) >= BULK_EVENTS
    assert created and set(created) == {201}, created
    assert served and set(served) == {200}, served
    audited = _exports_after(gateway, before)
    assert [event.outcome for event in audited] == ["success"] * statuses.count(200)
