"""One record per API request, filled in along the way and settled exactly once.

Every request under /v1 gets a `Settlement` before anything else happens to it. Handlers note
what they learn (who asked, the plan, usage, the outcome); the request middleware calls
`settle` once, in a `finally`, whatever happened: a bad key, a body that failed validation, a
413, an unhandled exception, a cancelled stream. `settle` is the only place that writes the
request's audit event, counts it in the metrics and releases its rate-limit admission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.request import Timings, Usage
from gateway.auth.key_auth import Caller
from gateway.errors import APIError
from gateway.limits.limiter import Admission
from gateway.state import GatewayState
from tenancy.audit_chain import AuditRecord

# The audit action of each API route; anything else under /v1 is "api.other".
_ACTIONS = {
    ("POST", "/v1/chat/completions"): ("inference.chat", "chat"),
    ("POST", "/v1/completions"): ("inference.completions", "completions"),
    ("GET", "/v1/models"): ("models.list", "models"),
}
CLIENT_CLOSED = 499  # nginx's status for a client that left before the response


@dataclass
class Settlement:
    """What one request did; `settle` turns it into one audit event and its metrics."""

    action: str
    endpoint: str
    path: str
    source_ip: str | None
    started: float = field(default_factory=time.perf_counter)
    caller: Caller | None = None  # set by the gate once the key is checked
    auth_failure: str | None = None  # why the key was refused, for the audit event
    key_id: str | None = None  # a refused key's public id, when it had one
    status: int | None = None  # the HTTP status sent, if a response started
    outcome: str | None = None  # success, failure, rejected or cancelled, once decided
    error: APIError | None = None
    request_id: str | None = None
    model: str | None = None  # the model the body asked for, once it parsed
    usage: Usage | None = None
    timings: Timings | None = None
    admission: Admission | None = None
    details: dict[str, Any] = field(default_factory=dict)
    settled: bool = False

    @classmethod
    def for_request(cls, method: str, path: str, source_ip: str | None) -> Settlement:
        action, endpoint = _ACTIONS.get((method, path), ("api.other", "other"))
        return cls(action, endpoint, path, source_ip)

    def note_error(self, error: APIError) -> None:
        """The error the client is about to see (the first one wins)."""
        if self.error is None:
            self.error = error

    def note_error_from(self, scope_state: dict[str, Any]) -> None:
        """The error an exception handler answered with, if any (see `respond_with`)."""
        error = scope_state.get("api_error")
        if isinstance(error, APIError):
            self.note_error(error)

    def conclude(
        self,
        outcome: str,
        usage: Usage | None = None,
        error: APIError | None = None,
        timings: Timings | None = None,
    ) -> None:
        """How the request ended, as its handler saw it (the first conclusion wins)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.usage = usage
        self.timings = timings
        if error is not None:
            self.note_error(error)

    def final_outcome(self) -> str:
        if self.outcome is not None:
            return self.outcome
        status = self.status or CLIENT_CLOSED
        if status == CLIENT_CLOSED:
            return "cancelled"
        if status >= 500:
            return "failure"
        return "rejected" if status >= 400 else "success"


def settle(state: GatewayState, settlement: Settlement) -> None:
    """Rate-limit release, the one audit event and the metrics of a request that ended."""
    if settlement.settled:
        return
    settlement.settled = True
    seconds = time.perf_counter() - settlement.started
    status = settlement.status or CLIENT_CLOSED
    usage = settlement.usage
    try:  # the slot and the audit event first: nothing after them may cost either
        if settlement.admission is not None:
            used = None if usage is None else usage.prompt_tokens + usage.completion_tokens
            settlement.admission.release(used)
    finally:
        state.audit.put(_audit_record(state, settlement, status, seconds))
    metrics = state.metrics
    metrics.requests.labels(settlement.endpoint, str(status)).inc()
    metrics.latency.labels(settlement.endpoint).observe(seconds)
    caller = settlement.caller
    if usage is not None and caller is not None:
        metrics.prompt_tokens.labels(caller.tenant_slug).inc(usage.prompt_tokens)
        metrics.cached_tokens.labels(caller.tenant_slug).inc(usage.cached_tokens)
        metrics.completion_tokens.labels(caller.tenant_slug).inc(usage.completion_tokens)
    if caller is not None:
        state.usage.count_request(caller.tenant_id, failed=settlement.final_outcome() != "success")
    if settlement.timings is not None:
        timings = settlement.timings
        metrics.ttft.observe(max(0.0, timings.first_token - timings.arrived))


def _audit_record(
    state: GatewayState, settlement: Settlement, status: int, seconds: float
) -> AuditRecord:
    caller = settlement.caller
    if settlement.auth_failure is not None:  # its key was refused: an auth event
        return AuditRecord(
            actor_type="api_key",
            actor_id=settlement.key_id,
            action="auth",
            outcome="failure",
            resource_type="endpoint",
            resource_id=settlement.path,
            source_ip=settlement.source_ip,
            request_id=settlement.request_id,
            details={"reason": settlement.auth_failure, "status": status},
        )
    details: dict[str, Any] = {
        "endpoint": settlement.endpoint,
        "model": settlement.model,
        "status": status,
        "latency_ms": round(seconds * 1000, 2),
        **settlement.details,
    }
    if settlement.usage is not None:
        details.update(
            prompt_tokens=settlement.usage.prompt_tokens,
            cached_tokens=settlement.usage.cached_tokens,
            completion_tokens=settlement.usage.completion_tokens,
        )
        cache = settlement.usage.cache
        if cache is not None and caller is not None:
            details.update(
                cached_by_source=cache.cached,
                tier_loads=cache.tier_loads,
                tier_bytes=cache.tier_bytes,
                evicted_blocks=_evictions(cache.evicted, caller.tenant_id),
            )
    if settlement.error is not None:
        details["error"] = _error_code(settlement)
        details["param"] = settlement.error.param
    return AuditRecord(  # without a caller: refused before its key could be checked
        actor_type="api_key",
        actor_id=caller.key_id if caller else None,
        tenant_id=caller.tenant_id if caller else None,
        action=settlement.action,
        resource_type="model" if settlement.model else "endpoint",
        resource_id=settlement.model or settlement.path,
        outcome=settlement.final_outcome(),
        request_id=settlement.request_id,
        source_ip=settlement.source_ip,
        details=details,
    )


def _evictions(evicted: dict[str, int], tenant_id: str) -> dict[str, int]:
    """The blocks a request's allocations evicted: its own tenant's, the public budget's and
    other tenants' together. A tenant's administrators read their tenant's events, so no
    other tenant's id (or how many of its blocks were cached) is named there; each tenant's
    own counters (`evicted_pressure_blocks`) say what others' pressure cost it."""
    own = evicted.get(tenant_id, 0)
    public = evicted.get("public", 0)
    return {"own": own, "public": public, "other_tenants": sum(evicted.values()) - own - public}


def _error_code(settlement: Settlement) -> str | None:
    error = settlement.error
    return None if error is None else error.code or error.error_type
