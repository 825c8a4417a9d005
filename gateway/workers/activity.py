"""What a worker reports of its engine's work beyond the cache, in its state
(`GET /internal/v1/state`): each tenant's sequences in flight, which routing weighs a request
by; each tenant's service since the engine started; and the engine's step times (and, from
its `describe`, its step-time target).

Every part is bounded: the sequences name only tenants with work on the worker now, the
service only tenants it has served since it started, and the step times carry the latest
`RECENT_STEPS` samples at most. A worker of the previous version sends none of them, and a part
that cannot be read counts as not sent: the tenants are then unknown (routing weighs the
worker by its total in flight, as before), the service and the steps empty. A report is never
a reason to take a worker out of routing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.engine import Engine
from engine.metrics import TenantService

# Step times a worker sends with each poll: the latest ones, enough for a recent p99.
RECENT_STEPS = 256
# The quantiles of recent step times a gateway shows.
STEP_QUANTILES = (0.5, 0.99)

Json = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepTimes:
    """An engine's steps since it started, their total time, and the latest ones' times."""

    steps: int = 0
    seconds_total: float = 0.0
    recent: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Activity:
    """A worker's report, as read by a gateway."""

    tenant_sequences: dict[str, int] | None = None  # None: the worker does not say
    service: dict[str, TenantService] = field(default_factory=dict)
    steps: StepTimes = StepTimes()
    step_target_ms: float | None = None  # its engine's step-time target (`describe`'s step cost)


def activity_json(engine: Engine) -> Json:
    """The report of the engine in this worker, as of its last step."""
    metrics = engine.metrics
    recent = tuple(metrics.step_seconds)[-RECENT_STEPS:]  # a copy: the engine thread appends
    return {
        "tenant_sequences": engine.tenant_sequences(),  # a copy already
        "service": {
            tenant_id: dataclasses.asdict(service)
            for tenant_id, service in engine.service_stats().items()
        },
        "steps": {
            "count": metrics.steps,
            "seconds_total": metrics.step_seconds_total,
            "recent": list(recent),
        },
    }


def read_activity(state: Json) -> Activity:
    """A worker's report from its state; what is missing or unreadable counts as not sent."""
    return Activity(
        tenant_sequences=_lenient(_read_sequences, state.get("tenant_sequences"), None),
        service=_lenient(_read_service, state.get("service"), {}),
        steps=_lenient(_read_steps, state.get("steps"), StepTimes()),
        step_target_ms=_lenient(_read_target, state.get("describe"), None),
    )


def quantiles(samples: Collection[float]) -> dict[float, float]:
    """`STEP_QUANTILES` of `samples` by nearest rank (none of no samples)."""
    if not samples:
        return {}
    ordered = sorted(samples)
    last = len(ordered) - 1
    return {q: ordered[min(last, max(0, math.ceil(q * len(ordered)) - 1))] for q in STEP_QUANTILES}


def total_service(parts: Iterable[Mapping[str, TenantService]]) -> dict[str, TenantService]:
    """Several engines' service as one: each tenant's summed over the engines it was served by."""
    total: dict[str, TenantService] = {}
    for part in parts:
        for tenant_id, service in part.items():
            seen = total.get(tenant_id, TenantService())
            total[tenant_id] = TenantService(
                prefill_tokens=seen.prefill_tokens + service.prefill_tokens,
                decode_tokens=seen.decode_tokens + service.decode_tokens,
                service=seen.service + service.service,
            )
    return total


def _lenient(read: Callable[[Any], T], data: Any, missing: T) -> T:
    if data is None:
        return missing
    try:
        return read(data)
    except (AttributeError, KeyError, TypeError, ValueError):
        return missing


def _read_sequences(data: Any) -> dict[str, int]:
    counts = {str(tenant_id): int(count) for tenant_id, count in data.items()}
    return {tenant_id: count for tenant_id, count in counts.items() if count > 0}


def _read_service(data: Any) -> dict[str, TenantService]:
    return {
        str(tenant_id): TenantService(
            prefill_tokens=int(service["prefill_tokens"]),
            decode_tokens=int(service["decode_tokens"]),
            service=float(service["service"]),
        )
        for tenant_id, service in data.items()
    }


def _read_steps(data: Any) -> StepTimes:
    recent = tuple(float(seconds) for seconds in data["recent"][-RECENT_STEPS:])
    return StepTimes(int(data["count"]), float(data["seconds_total"]), recent)


def _read_target(describe: Any) -> float | None:
    target = describe.get("step_cost", {}).get("target_ms")
    return None if target is None else float(target)
