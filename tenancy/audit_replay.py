"""Replaying dead letters: events the database once refused, appended after a fix, once each.

The dead-letter file (`AuditLog.dead_letter_path`) holds one JSON line per refused event,
`{"rejected_at", "error", "event"}`. A replay hands the events, in batches, to the log's own
append (`AuditLog.resubmit`): fitted to their columns, chained, checkpointed, as if they had
been written the first time. They keep their id and time; only their place in the chain is new.

Exactly once rests on the id every event carries from birth: the database's `event_id` column
is unique, and an append skips ids already stored (on PostgreSQL under the chain head's row
lock). So a replay interrupted midway and run again, or run on two hosts at once against one
database, stores each event once. The file is rewritten only after the database committed, under the
file's lock (the gateway appends new dead letters under it too), and only loses lines whose
event is stored: an event still refused stays, with the new reason, and so does a line that is
not a dead letter (corrupt, edited, or a spool line that never parsed), for a person to mend.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenancy import audit_files
from tenancy.audit_bounds import bounded
from tenancy.audit_chain import AuditRecord
from tenancy.audit_files import UnreadableAuditFile
from tenancy.audit_log import BATCH_EVENTS, AuditLog, Delivery, dead_letter_line

# Called with (events handled so far, events to replay), before the first batch and after each.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One line of the file: its event when it holds one, else why it cannot be replayed."""

    line: int  # from 1
    raw: bytes  # as stored, kept verbatim while the event is not stored
    event: dict[str, Any] | None = None
    record: AuditRecord | None = None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class StillFailing:
    """An event that stays in the file: the database refused it again, or was unreachable."""

    line: int
    event_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class UnreadableLine:
    """A line that holds no event to replay; it stays in the file as it is."""

    line: int
    problem: str


@dataclass(slots=True)
class ReplayResult:
    """What a replay did, counted in events (a line repeated in the file counts once)."""

    replayed: int = 0
    already_stored: int = 0
    still_failing: list[StillFailing] = field(default_factory=list)
    unreadable: list[UnreadableLine] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether the file is empty now: every event stored, no line left to mend."""
        return not self.still_failing and not self.unreadable


def replay_dead_letters(
    log: AuditLog,
    path: Path,
    progress: Progress = lambda _done, _total: None,
    batch: int = BATCH_EVENTS,
) -> ReplayResult:
    """Append the events of the dead-letter file at `path` to the chain, each exactly once.

    Raises UnreadableAuditFile when `path` is missing, unreadable or not a dead-letter file
    (nothing is written then), and OSError when its lock cannot be taken or it cannot be
    rewritten afterwards (what was replayed is stored then; running again skips it).
    """
    _check_file(path)
    with audit_files.locked(path):
        letters = read_dead_letters(path)
        pending = _unique_events(letters)
        outcomes = _Outcomes()
        progress(0, len(pending))
        for start in range(0, len(pending), batch):
            delivery = log.resubmit(pending[start : start + batch])
            outcomes.note(delivery)
            progress(min(start + batch, len(pending)), len(pending))
            if delivery.outage is not None:
                break
        audit_files.replace_lines(path, outcomes.kept_lines(letters))
    if outcomes.replayed:
        log.checkpoint_now()  # attest the new head at once, as an export does
    return ReplayResult(
        outcomes.replayed,
        outcomes.already_stored,
        outcomes.still_failing(letters),
        [UnreadableLine(letter.line, letter.problem) for letter in letters if letter.problem],
    )


def read_dead_letters(path: Path) -> list[DeadLetter]:
    """Every non-blank line of the file at `path`, read as a dead letter or said why not."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UnreadableAuditFile(f"cannot read {path}: {error.strerror}") from error
    letters = [
        _read_line(number, raw)
        for number, raw in enumerate(data.split(b"\n"), start=1)
        if raw.strip()
    ]
    if letters and all(letter.event is None for letter in letters):
        first = letters[0]
        raise UnreadableAuditFile(
            f"{path} is not a dead-letter file (line {first.line}: {first.problem})"
        )
    return letters


def _check_file(path: Path) -> None:
    """Refuse a path that is not a regular file before anything (its lock) is created."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise UnreadableAuditFile(f"cannot read {path}: {error.strerror}") from error
    if not stat.S_ISREG(mode):
        raise UnreadableAuditFile(f"cannot read {path}: not a regular file")


def _read_line(number: int, raw: bytes) -> DeadLetter:
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return DeadLetter(number, raw, problem="not UTF-8 text")
    except ValueError:
        return DeadLetter(number, raw, problem="not JSON")
    event = value.get("event") if isinstance(value, dict) else None
    if not isinstance(event, dict):
        return DeadLetter(number, raw, problem="not a dead letter (no event)")
    if "unparsed_spool_line" in event:
        problem = "a spool line that never parsed, not an event"
        return DeadLetter(number, raw, event, problem=problem)
    try:
        record = bounded(AuditRecord.from_json(event))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        problem = f"its event cannot be read ({type(error).__name__}: {error})"
        return DeadLetter(number, raw, event, problem=problem)
    return DeadLetter(number, raw, event, record)


def _unique_events(letters: list[DeadLetter]) -> list[AuditRecord]:
    """The events to replay, in file order, each id once (a crash may have kept one twice)."""
    events: dict[str, AuditRecord] = {}
    for letter in letters:
        if letter.record is not None:
            events.setdefault(str(letter.record.event_id), letter.record)
    return list(events.values())


@dataclass(slots=True)
class _Outcomes:
    """What became of each event id; an id in neither set was not tried (the database left)."""

    replayed: int = 0
    already_stored: int = 0
    stored: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)  # id -> why, this time
    outage: str | None = None

    def note(self, delivery: Delivery) -> None:
        self.replayed += len(delivery.written)
        self.already_stored += len(delivery.already_stored)
        self.stored.update(str(r.event_id) for r in [*delivery.written, *delivery.already_stored])
        self.refused.update((str(record.event_id), why) for record, why in delivery.refused)
        self.outage = delivery.outage

    def still_failing(self, letters: list[DeadLetter]) -> list[StillFailing]:
        """Each event not stored, once, at its first line, with why."""
        failing: dict[str, StillFailing] = {}
        for letter in letters:
            if letter.record is None:
                continue
            event_id = str(letter.record.event_id)
            if event_id in self.stored or event_id in failing:
                continue
            reason = self.refused.get(event_id) or (
                f"not tried: the database is unreachable ({self.outage})"
            )
            failing[event_id] = StillFailing(letter.line, event_id, reason)
        return list(failing.values())

    def kept_lines(self, letters: list[DeadLetter]) -> list[str | bytes]:
        """What stays in the file: every line but those whose event is stored now.

        An event refused again keeps one line, with the new reason; any other line stays
        byte for byte.
        """
        kept: list[str | bytes] = []
        refreshed: set[str] = set()
        for letter in letters:
            event_id = None if letter.record is None else str(letter.record.event_id)
            if event_id is None or letter.event is None or event_id not in self.refused:
                if event_id not in self.stored:
                    kept.append(letter.raw)
            elif event_id not in refreshed:
                refreshed.add(event_id)
                kept.append(
                    audit_files.dumps(dead_letter_line(letter.event, self.refused[event_id]))
                )
        return kept
