"""Reading the audit log, on PostgreSQL and SQLite: a filter selects exactly its events (its
bounds in UTC whatever their offset), pages walk them once, exports of a filtered set verify
(also read a page per transaction), and request totals are summed in SQL."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from tenancy.audit_chain import AuditRecord
from tenancy.audit_export import (
    ExportFilter,
    ExportTooLarge,
    export_events,
    write_export,
    write_export_in_pages,
)
from tenancy.audit_search import (
    AuditFilter,
    count_events,
    last_seq,
    request_totals,
    search_events,
)
from tenancy.audit_verification import VerifyResult, verify_database, verify_file
from tenancy.errors import InvalidInput
from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.cli import Cli

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ALPHA, BETA = "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222"
# (minutes after T0, tenant, action, outcome): a little of everything a filter tells apart.
EVENTS = [
    (0, ALPHA, "tenant.create", "success"),
    (1, BETA, "tenant.create", "success"),
    (2, ALPHA, "tenant.update", "failure"),
    (3, None, "admin.login", "success"),
    (4, ALPHA, "tenant_x.update", "success"),  # "_" must not act as a LIKE wildcard
    (5, ALPHA, "api_key.create", "success"),
    (6, BETA, "tenant.update", "success"),
    (7, ALPHA, "tenant.set_quota", "success"),
]
FILTERS = [
    AuditFilter(),
    AuditFilter(tenant_id=ALPHA),
    AuditFilter(action="tenant.update"),
    AuditFilter(action="tenant."),
    AuditFilter(action="tenant.*"),
    AuditFilter(action="tenant_*"),
    AuditFilter(outcome="failure"),
    AuditFilter(tenant_id=ALPHA, action="tenant.*", outcome="success"),
    AuditFilter(since=T0 + timedelta(minutes=2), until=T0 + timedelta(minutes=6)),
    AuditFilter(tenant_id=BETA, since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=6)),
]


def record_events(store: Store) -> None:
    for minute, tenant_id, action, outcome in EVENTS:
        store.record(
            AuditRecord(
                "operator", action, outcome,
                tenant_id=tenant_id, time=T0 + timedelta(minutes=minute),
            )
        )  # fmt: skip


def expected_seqs(selection: AuditFilter) -> list[int]:
    """The sequence numbers (from 1, in order) of the EVENTS the filter should select."""
    selected = []
    for seq, (minute, tenant_id, action, outcome) in enumerate(EVENTS, start=1):
        time = T0 + timedelta(minutes=minute)
        prefix = selection.action.rstrip("*") if selection.action else None
        is_prefix = selection.action is not None and selection.action[-1] in ".*"
        if (
            (selection.tenant_id is None or tenant_id == selection.tenant_id)
            and (selection.outcome is None or outcome == selection.outcome)
            and (selection.since is None or time >= selection.since)
            and (selection.until is None or time < selection.until)
            and (
                prefix is None
                or (action.startswith(prefix) if is_prefix else action == selection.action)
            )
        ):
            selected.append(seq)
    return selected


@pytest.mark.parametrize("selection", FILTERS, ids=repr)
def test_a_filter_selects_exactly_its_events_newest_first(
    store: Store, selection: AuditFilter
) -> None:
    record_events(store)
    with store.transaction() as session:
        page = search_events(session, selection, limit=100)
        assert [event.seq for event in page.events] == expected_seqs(selection)[::-1]
        assert page.next_cursor is None
    assert expected_seqs(selection), "every filter here selects something"


KIRITIMATI, NEWFOUNDLAND = timezone(timedelta(hours=14)), timezone(-timedelta(hours=3, minutes=30))
# The bounds below, as an export's header states them.
UTC_BOUNDS = {f"2026-03-01T12:0{minute}:00.000000Z" for minute in range(10)}


@pytest.mark.parametrize("zone", [KIRITIMATI, NEWFOUNDLAND], ids=["+14:00", "-03:30"])
@pytest.mark.parametrize(
    "selection",
    [f for f in FILTERS if f.since or f.until]
    + [AuditFilter(since=T0 + timedelta(minutes=3)), AuditFilter(until=T0 + timedelta(minutes=1))],
    ids=repr,
)
def test_a_bound_with_an_offset_selects_what_its_utc_twin_selects(
    store: Store, selection: AuditFilter, zone: timezone
) -> None:
    record_events(store)
    shifted = AuditFilter(
        selection.tenant_id,
        None if selection.since is None else selection.since.astimezone(zone),
        None if selection.until is None else selection.until.astimezone(zone),
    )
    with store.transaction() as session:
        page = search_events(session, shifted, limit=100)
        assert [event.seq for event in page.events] == expected_seqs(selection)[::-1]
        assert count_events(session, shifted) == len(expected_seqs(selection))
        stream = io.StringIO(newline="")
        write_export(session, shifted, stream, "jsonl", store.signing_key)
    # The export states the range it holds, in UTC, exactly as its UTC twin would.
    header = json.loads(stream.getvalue().splitlines()[0])
    assert header["filter"] == selection.as_dict()
    assert all(header["filter"][bound] in (None, *UTC_BOUNDS) for bound in ("since", "until"))


@pytest.mark.parametrize(
    ("since", "until", "field"),
    [
        (datetime(1, 1, 1, tzinfo=KIRITIMATI), T0, "since"),
        (T0, datetime(9999, 12, 31, 23, tzinfo=NEWFOUNDLAND), "until"),
    ],
)
def test_a_bound_without_a_time_in_utc_is_refused_by_name(
    store: Store, since: datetime, until: datetime, field: str
) -> None:
    with pytest.raises(InvalidInput, match=f"{field} is out of range") as refused:
        AuditFilter(since=since, until=until)
    assert refused.value.field == field
    with store.transaction() as session, pytest.raises(InvalidInput) as refused:
        request_totals(session, ALPHA, since, until)
    assert refused.value.field == field


def test_a_naive_bound_is_read_as_utc(store: Store) -> None:
    record_events(store)
    naive = AuditFilter(since=datetime(2026, 3, 1, 12, 2), until=datetime(2026, 3, 1, 12, 6))
    assert naive == FILTERS[8]
    with store.transaction() as session:
        assert count_events(session, naive) == len(expected_seqs(FILTERS[8])) == 4


def test_pages_walk_every_event_once_and_see_nothing_appended_twice(store: Store) -> None:
    record_events(store)
    walked, cursor = [], None
    with store.transaction() as session:
        while True:
            page = search_events(session, AuditFilter(), 3, before_seq=cursor)
            walked += [event.seq for event in page.events]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    assert walked == list(range(len(EVENTS), 0, -1))
    store.record(AuditRecord("cli", "tenant.create", "success"))  # appended while paging
    with store.transaction() as session:
        forward = search_events(session, AuditFilter(), 5, after_seq=6)
        assert [event.seq for event in forward.events] == [7, 8, 9]
        assert forward.next_cursor is None
        with pytest.raises(InvalidInput):
            search_events(session, AuditFilter(), 5, before_seq=3, after_seq=1)


def test_a_filtered_export_holds_exactly_the_selected_events_and_verifies(
    store: Store, tmp_path: Path
) -> None:
    record_events(store)
    selection = AuditFilter(tenant_id=ALPHA, action="tenant.*", outcome="success")
    for file_format in ("jsonl", "csv"):
        out = tmp_path / f"alpha.{file_format}"
        with store.transaction() as session:
            assert export_events(session, selection, out, file_format, store.signing_key) == 2
        result = verify_file(out, store.signing_key)
        assert result.ok and result.events == 2, result.problem
    text = (tmp_path / "alpha.jsonl").read_text()
    assert BETA not in text and "tenant_x.update" not in text and "failure" not in text


def test_the_stream_and_the_file_are_one_format(store: Store, tmp_path: Path) -> None:
    record_events(store)
    stream = io.StringIO(newline="")
    with store.transaction() as session:
        assert write_export(session, ExportFilter(), stream, "csv", store.signing_key) == 8
    out = tmp_path / "stream.csv"
    out.write_text(stream.getvalue(), newline="")
    assert verify_file(out, store.signing_key).ok
    with store.transaction() as session:
        export_events(session, ExportFilter(), tmp_path / "file.csv", "csv", store.signing_key)
    # Equal but for the header's export time.
    streamed, written = out.read_text().splitlines(), (tmp_path / "file.csv").read_text()
    assert streamed[2:] == written.splitlines()[2:] and streamed[0] == written.splitlines()[0]


def test_an_export_past_its_cap_is_refused_by_name(store: Store) -> None:
    record_events(store)
    with store.transaction() as session:
        assert write_export(session, ExportFilter(), io.StringIO(), "jsonl", "k", 8) == 8
        with pytest.raises(ExportTooLarge, match="more than 7 events"):
            write_export(session, ExportFilter(), io.StringIO(), "jsonl", "k", 7)


def test_an_export_in_pages_is_the_snapshot_counted_before_it(store: Store, tmp_path: Path) -> None:
    """Read a page per transaction up to the newest event at the count: the same export as
    one read, whatever is appended meanwhile."""
    store.audit.record_many(
        [
            AuditRecord("cli", "tenant.update", "success", tenant_id=ALPHA if n % 3 else BETA)
            for n in range(2500)
        ]
    )
    selection = AuditFilter(tenant_id=ALPHA)
    whole = io.StringIO(newline="")
    with store.transaction() as session:
        through_seq = last_seq(session)
        counted = count_events(session, selection, through_seq)
        write_export(session, selection, whole, "csv", store.signing_key)
    assert (through_seq, counted) == (2500, 1666)
    store.record(AuditRecord("cli", "tenant.update", "success", tenant_id=ALPHA))  # too late
    opened = []

    @contextmanager
    def transaction() -> Iterator[Session]:
        opened.append(1)
        with store.transaction() as session:
            yield session

    paged = io.StringIO(newline="")
    assert (
        write_export_in_pages(transaction, selection, paged, "csv", store.signing_key, through_seq)
        == counted
    )
    assert len(opened) == 2  # 1,666 events in pages of 1,000, each its own transaction
    # Equal but for the header's export time (line 2; line 1 names the columns).
    assert paged.getvalue().splitlines()[2:] == whole.getvalue().splitlines()[2:]
    out = tmp_path / "paged.csv"
    out.write_text(paged.getvalue(), newline="")
    assert verify_file(out, store.signing_key) == VerifyResult(True, counted)


def request(
    store: Store, tenant_id: str | None, outcome: str = "success", at: datetime = T0, **tokens: int
) -> None:
    """The audit event of one /v1 chat request, with the usage it reported."""
    store.record(
        AuditRecord(
            "api_key", "inference.chat", outcome,
            tenant_id=tenant_id, time=at, details={"status": 200, **tokens},
        )
    )  # fmt: skip


def test_request_totals_sum_one_tenants_request_events_only(store: Store) -> None:
    request(store, ALPHA, prompt_tokens=100, cached_tokens=64, completion_tokens=8)
    request(store, ALPHA, prompt_tokens=50, cached_tokens=0, completion_tokens=4)
    request(store, ALPHA, "rejected")  # refused before it had usage
    request(store, BETA, prompt_tokens=1000, cached_tokens=1000, completion_tokens=1)
    store.record(AuditRecord("operator", "tenant.update", "success", tenant_id=ALPHA, time=T0,
                             details={"prompt_tokens": 5000}))  # fmt: skip
    request(store, ALPHA, at=T0 + timedelta(days=1), prompt_tokens=7)  # just past the range
    with store.transaction() as session:
        totals = request_totals(session, ALPHA, T0, T0 + timedelta(days=1))
    assert (totals.requests, totals.errors) == (3, 1)
    assert (totals.prompt_tokens, totals.cached_tokens, totals.completion_tokens) == (150, 64, 12)
    assert totals.hit_ratio == pytest.approx(64 / 150)
    with store.transaction() as session:
        beta = request_totals(session, BETA, T0, T0 + timedelta(days=1))
        nobody = request_totals(session, "unknown", T0, T0 + timedelta(days=1))
    assert (beta.requests, beta.prompt_tokens) == (1, 1000)
    assert (nobody.requests, nobody.prompt_tokens, nobody.hit_ratio) == (0, 0, 0.0)


def test_request_totals_refuse_an_empty_or_too_long_range(store: Store) -> None:
    with store.transaction() as session:
        with pytest.raises(InvalidInput, match="before until"):
            request_totals(session, ALPHA, T0, T0)
        with pytest.raises(InvalidInput, match="at most 90 days"):
            request_totals(session, ALPHA, T0, T0 + timedelta(days=91))


def test_the_chain_verifies_while_events_are_appended(postgres_url: str, tmp_path: Path) -> None:
    """Events committed while the chain is read move the head on; that is not a cut tail."""
    store = Store.open(postgres_url, tmp_path / "audit.spool", "k", "signing-key", 100)
    try:
        verify_while_appending(store)
    finally:
        store.close()


def verify_while_appending(store: Store) -> None:
    store.audit.record_many([AuditRecord("cli", "tenant.create", "success") for _ in range(3000)])
    stop = threading.Event()

    def append() -> None:
        while not stop.is_set():
            store.record(AuditRecord("cli", "tenant.update", "success"))

    writer = threading.Thread(target=append)
    writer.start()
    try:
        results = []
        for _ in range(3):
            with store.transaction() as session:
                results.append(verify_database(session, store.signing_key))
    finally:
        stop.set()
        writer.join()
    assert all(result.ok for result in results), [result.problem for result in results]
    with store.transaction() as session:
        last = session.scalar(select(AuditEvent.seq).order_by(AuditEvent.seq.desc()).limit(1))
    assert last is not None and last > 3000  # the writer did append during the checks


def test_cli_export_filters_by_action_and_outcome(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    cli.ok("tenants", "create", "globex")
    assert cli.run("tenants", "create", "acme").returncode != 0  # audited as a failure
    out = tmp_path / "created.jsonl"
    listed = cli.ok(
        "audit", "export", "--out", str(out), "--action", "tenant.*", "--outcome", "success"
    )
    assert "exported 2 events" in listed
    assert cli.ok("audit", "verify", str(out)).startswith("ok: 2 events verified")
    assert '"failure"' not in out.read_text()
