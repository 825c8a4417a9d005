"""`audit verify` exits 2 for input it cannot read, 1 only for tampering, never a traceback."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tenancy.audit_chain import AuditRecord
from tenancy.audit_export import CSV_COLUMNS, ExportFilter, export_events
from tenancy.store import Store
from tests.support.cli import Cli


@pytest.fixture(scope="module")
def exported(migrated_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A CLI on its own database, and a valid three-event JSONL export signed for it."""
    from tests.support.postgres import create_database, database_url, drop_database

    name = create_database(template=migrated_template)
    workdir = tmp_path_factory.mktemp("verify-input")
    store = Store.open(database_url(name), workdir / "spool", "k", "cli-signing-key", 100)
    for index in range(3):
        store.record(AuditRecord("cli", "tenant.create", "success", details={"n": index}))
    with store.transaction() as session:
        export_events(session, ExportFilter(), workdir / "audit.jsonl", "jsonl", "cli-signing-key")
    store.close()
    yield Cli(database_url(name), workdir / "state"), workdir / "audit.jsonl"
    drop_database(name)


def with_record(kind: str, change: Callable[[dict[str, Any]], None]) -> Callable[[str], str]:
    """An edit of the valid export that changes the first record of `kind`."""

    def edit(text: str) -> str:
        lines = text.splitlines()
        for number, line in enumerate(lines):
            record = json.loads(line)
            if record["record"] == kind:
                change(record)
                lines[number] = json.dumps(record)
                break
        return "\n".join(lines) + "\n"

    return edit


UNREADABLE: dict[str, tuple[Callable[[str], str | bytes] | None, str]] = {
    "missing-file": (None, "cannot read"),
    "not-json": (lambda _: "this is not an export\n", "line 1 is not JSON"),
    "json-list": (lambda _: "[1, 2, 3]\n", "line 1 is not a JSON object"),
    "json-scalar": (lambda _: '"header"\n', "line 1 is not a JSON object"),
    "empty": (lambda _: "", "not a PrefixGate audit export"),
    "unknown-record": (lambda _: '{"record": "footer"}\n', "not a header, event or trailer"),
    "no-header": (lambda text: "\n".join(text.splitlines()[1:]), "not a PrefixGate audit export"),
    "csv-wrong-columns": (lambda _: "record,who,what\nevent,me,it\n", "the CSV columns are not"),
    "csv-short-row": (lambda _: ",".join(CSV_COLUMNS) + "\nheader,1\n", "has 2 cells"),
    "binary": (lambda _: bytes(range(256)) * 4, "is not a text file"),
    "nul-bytes": (lambda text: text.replace("event", "ev\x00ent", 1), "is not a text file"),
    "event-seq-not-a-number": (
        with_record("event", lambda event: event.update(seq="1")),
        "an event needs an integer seq",
    ),
    "trailer-without-seqs": (
        with_record("trailer", lambda trailer: trailer.pop("seqs")),
        "a trailer needs",
    ),
    "trailer-seqs-not-numbers": (
        with_record("trailer", lambda trailer: trailer.update(seqs=[[1, "x"]])),
        "a trailer needs",
    ),
}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_unreadable_or_malformed_input_exits_2_in_one_line(
    kind: str, exported: tuple[Cli, Path], tmp_path: Path
) -> None:
    cli, original = exported
    make, message = UNREADABLE[kind]
    target = tmp_path / "input.jsonl"
    if make is not None:
        content = make(original.read_text())
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    line = cli.error("audit", "verify", str(target), code=2)
    assert line.startswith("prefixgate: error: ") and message in line, line


def test_a_directory_is_unreadable_input(exported: tuple[Cli, Path], tmp_path: Path) -> None:
    cli, _ = exported
    assert "cannot read" in cli.error("audit", "verify", str(tmp_path), code=2)


def test_the_valid_export_verifies_and_a_forged_signature_exits_1(
    exported: tuple[Cli, Path], tmp_path: Path
) -> None:
    cli, original = exported
    assert cli.ok("audit", "verify", str(original)).startswith("ok: 3 events verified")
    forged = tmp_path / "forged.jsonl"
    edit = with_record("trailer", lambda trailer: trailer.update(signature="0" * 64))
    forged.write_text(edit(original.read_text()))
    line = cli.error("audit", "verify", str(forged), code=1)
    assert "the trailer's signature is invalid" in line
    # An unsigned claim of 10^15 events is refused without expanding it.
    edit = with_record("trailer", lambda trailer: trailer.update(seqs=[[1, 10**15]]))
    forged.write_text(edit(original.read_text()))
    line = cli.error("audit", "verify", str(forged), code=1)
    assert "the trailer's signature is invalid" in line
