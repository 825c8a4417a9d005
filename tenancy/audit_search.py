"""Reading the audit log: which events a filter selects, one page at a time, and request totals.

`AuditFilter` is the one definition of "these events" (tenant, action or action prefix, outcome,
time range) for every reader: the admin API's search, its export and the CLI's export all
select through `AuditFilter.where`, so a download holds exactly the events the search shows.

Pages are keyset pages on the sequence number, never offsets: `before_seq` walks from the
newest event back (what an operator reads first), `after_seq` walks forward from a known event
(to follow what is new). A page costs the same however deep it is, and events appended while
someone pages never shift or repeat the rows they see.

Every bound is held in UTC: the filter converts an aware time to UTC and reads a naive one as
UTC (the CLI's convention), so a bound with any offset selects what its UTC twin selects on
every database, and the range an export's header states is the range it holds. A bound that
has no UTC equivalent (near the years 1 and 9999) is refused by name.

Request totals sum the usage every /v1 request's event carries in its details (written by
gateway/http/settlement.py) in one SQL aggregate. SQLAlchemy's JSON index with `as_integer()`
renders as `CAST(details ->> 'key' AS INTEGER)` on PostgreSQL and `JSON_EXTRACT` on SQLite, so the
same query runs on both and no row leaves the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVarTuple

from sqlalchemy import ColumnElement, Select, case, func, select
from sqlalchemy.orm import Session

from tenancy.audit_chain import format_time
from tenancy.errors import InvalidInput
from tenancy.models import AuditEvent

Ts = TypeVarTuple("Ts")

MAX_PAGE = 500  # events in one page of a search
MAX_TOTALS_RANGE = timedelta(days=90)  # the longest range request totals are summed over
# The actions of /v1 requests' events, as gateway/http/settlement.py names them (its `_ACTIONS`,
# and "api.other" for any other /v1 path). Auth failures ("auth") have no tenant: not counted.
REQUEST_ACTIONS = ("inference.chat", "inference.completions", "models.list", "api.other")


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """Which events: every field that is set must match (None matches anything).

    `action` is exact, or a prefix when it ends with "." or "*": `tenant.` and `tenant.*` both
    select tenant.create, tenant.update, ...; `since` is inclusive, `until` exclusive.
    """

    tenant_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    action: str | None = None
    outcome: str | None = None

    def __post_init__(self) -> None:
        """Hold both bounds in UTC; raises InvalidInput naming a bound that has no UTC time."""
        # A frozen dataclass sets its own fields through object.__setattr__.
        if self.since is not None:
            object.__setattr__(self, "since", _in_utc(self.since, "since"))
        if self.until is not None:
            object.__setattr__(self, "until", _in_utc(self.until, "until"))

    def as_dict(self) -> dict[str, str | None]:
        """The filter as an export's header and trailer record it."""
        values: dict[str, str | None] = {
            "tenant_id": self.tenant_id,
            "since": format_time(self.since) if self.since else None,
            "until": format_time(self.until) if self.until else None,
        }
        # Only when set, so an export without them reads exactly as exports always have.
        if self.action is not None:
            values["action"] = self.action
        if self.outcome is not None:
            values["outcome"] = self.outcome
        return values

    def where(self, query: Select[*Ts]) -> Select[*Ts]:
        """`query` (over audit_events) narrowed to the events this filter selects."""
        if self.tenant_id is not None:
            query = query.where(AuditEvent.tenant_id == self.tenant_id)
        if self.since is not None:
            query = query.where(AuditEvent.time >= self.since)
        if self.until is not None:
            query = query.where(AuditEvent.time < self.until)
        if self.action is not None:
            query = query.where(_action_matches(self.action))
        if self.outcome is not None:
            query = query.where(AuditEvent.outcome == self.outcome)
        return query


def count_events(session: Session, selection: AuditFilter, through_seq: int | None = None) -> int:
    """How many events the filter selects (up to sequence number `through_seq`), in one COUNT."""
    query = selection.where(select(func.count()).select_from(AuditEvent))
    if through_seq is not None:
        query = query.where(AuditEvent.seq <= through_seq)
    return int(session.execute(query).scalar_one())


def last_seq(session: Session) -> int:
    """The newest event's sequence number (0 for an empty log).

    Appends are serialised and never change an older event, so once this one is visible,
    every event up to it is: reading "up to last_seq" later, in other transactions, reads
    the same events as one snapshot taken now.
    """
    return int(session.execute(select(func.max(AuditEvent.seq))).scalar_one() or 0)


@dataclass(frozen=True, slots=True)
class AuditPage:
    """One page of events in the order asked for, and the cursor of the next (None: no more)."""

    events: list[AuditEvent]
    next_cursor: int | None


def search_events(
    session: Session,
    selection: AuditFilter,
    limit: int = 100,
    *,
    before_seq: int | None = None,
    after_seq: int | None = None,
) -> AuditPage:
    """One page of the selected events: newest first below `before_seq` (default: from the
    newest), or oldest first above `after_seq`.

    The next page is asked for with `next_cursor` in the same parameter. Raises InvalidInput
    for both cursors at once or a limit outside 1..MAX_PAGE.
    """
    if before_seq is not None and after_seq is not None:
        raise InvalidInput("give before_seq or after_seq, not both", "after_seq")
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit must be between 1 and {MAX_PAGE}", "limit")
    query = selection.where(select(AuditEvent))
    if after_seq is not None:
        query = query.where(AuditEvent.seq > after_seq).order_by(AuditEvent.seq)
    else:
        if before_seq is not None:
            query = query.where(AuditEvent.seq < before_seq)
        query = query.order_by(AuditEvent.seq.desc())
    # One row more than the page says whether there is a next page, without a count.
    rows = list(session.scalars(query.limit(limit + 1)))
    events = rows[:limit]
    return AuditPage(events, events[-1].seq if len(rows) > limit else None)


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """What a tenant's /v1 requests added up to over a time range, from their audit events."""

    requests: int
    errors: int  # requests whose outcome was not "success" (rejected, failed, cancelled)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def hit_ratio(self) -> float:
        """Prompt tokens served from the cache over prompt tokens (0 without prompts)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def request_totals(
    session: Session, tenant_id: str, since: datetime, until: datetime
) -> RequestTotals:
    """The tenant's request totals from `since` (inclusive) to `until` (exclusive).

    Raises InvalidInput (naming the field) for an empty range or one longer than
    MAX_TOTALS_RANGE: the sum reads every request event in the range.
    """
    since, until = _in_utc(since, "since"), _in_utc(until, "until")
    if since >= until:
        raise InvalidInput("since must be before until", "since")
    if until - since > MAX_TOTALS_RANGE:
        raise InvalidInput(
            f"the range may span at most {MAX_TOTALS_RANGE.days} days; narrow since/until",
            "since",
        )
    query = select(
        func.count(),
        func.coalesce(func.sum(case((AuditEvent.outcome != "success", 1), else_=0)), 0),
        _sum_detail("prompt_tokens"),
        _sum_detail("cached_tokens"),
        _sum_detail("completion_tokens"),
    ).where(AuditEvent.action.in_(REQUEST_ACTIONS))
    query = AuditFilter(tenant_id, since, until).where(query)
    requests, errors, prompt, cached, completion = session.execute(query).one()
    return RequestTotals(int(requests), int(errors), int(prompt), int(cached), int(completion))


def _in_utc(moment: datetime, field: str) -> datetime:
    """`moment` in UTC (naive: already UTC); InvalidInput naming `field` if it has none."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError as error:  # e.g. 0001-01-01T00:00+14:00 is in the year 0 in UTC
        raise InvalidInput(f"{field} is out of range: it has no time in UTC", field) from error


def _sum_detail(name: str) -> ColumnElement[Any]:
    """The sum of an integer in the events' details (events without it add nothing)."""
    return func.coalesce(func.sum(AuditEvent.details[name].as_integer()), 0)


def _action_matches(action: str) -> ColumnElement[bool]:
    if action.endswith("*"):
        return AuditEvent.action.startswith(action[:-1], autoescape=True)
    if action.endswith("."):
        return AuditEvent.action.startswith(action, autoescape=True)
    return AuditEvent.action == action
