"""The soak's checks once the engine is idle: the pool's invariants, nothing left behind
(blocks, sequences, concurrency slots), every free block zero, and one audit event per request.
See bench/soak.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import torch
from sqlalchemy import func, select

from bench.soak_clients import IDLE_TIMEOUT_S, Soaked, chat_body, http_client, send
from engine.engine import Engine
from gateway.limits.store import WINDOW_S
from gateway.state import GatewayState
from tenancy.models import AuditEvent

# -- after each scenario ---------------------------------------------------------------------


def engine_report(engine: Engine) -> dict[str, Any]:
    """What the engine holds now, read on its own thread between steps (so nothing moves
    under the reads). Blocks a cancel freed wait dirty for the next step's batched zeroing:
    they are zeroed first, as that step would, and counted."""
    pool = engine.pool
    zeroed_now = engine.cache.end_step()
    consistency = None
    try:
        pool.check_consistency()
    except AssertionError as error:
        consistency = str(error) or "check_consistency failed"
    free = [block.block_id for block in pool.blocks if block.owner is None]
    index = torch.tensor(free, dtype=torch.long, device=pool.kv.device)
    per_block = pool.kv.index_select(2, index).transpose(0, 2).reshape(len(free), -1)
    with engine._inbox.lock:
        in_flight = len(engine._requests)
    return {
        "in_flight_requests": in_flight,
        "waiting": len(engine.scheduler.waiting),
        "running": len(engine.scheduler.running),
        "cache_sequences": len(engine.cache._sequences),
        "active_blocks": pool.num_active,
        "free_blocks": len(free),
        "available_blocks": pool.num_available,
        "nonzero_free_blocks": int(per_block.ne(0).any(dim=1).sum()),
        "dirty_blocks_zeroed_at_check": zeroed_now,
        "consistency_error": consistency,
    }


def slots_in_use(state: GatewayState, tenant_ids: dict[str, str]) -> dict[str, int]:
    """Each tenant's concurrency slots taken now (the limiter keeps no public count)."""
    counts = {}
    for slug, tenant_id in tenant_ids.items():
        counts[slug] = state.limiter.local.slots_held(tenant_id)
    return counts


def _is_idle(engine: dict[str, Any], slots: dict[str, int]) -> bool:
    held = ("in_flight_requests", "waiting", "running", "cache_sequences", "active_blocks")
    return not any(engine[name] for name in held) and not any(slots.values())


async def idle_report(soaked: Soaked) -> dict[str, Any]:
    """Wait (bounded) until no request is left anywhere, then check everything that must be
    back: the engine's state, the pool, each tenant's slots, and one fresh request each."""
    engine = soaked.state.engine
    assert isinstance(engine, Engine), "the soak reads an in-process engine"
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        report = await asyncio.to_thread(engine._inbox.call, lambda: engine_report(engine))
        slots = slots_in_use(soaked.state, soaked.tenant_ids)
        if _is_idle(report, slots) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    report["settle_s"] = round(IDLE_TIMEOUT_S - (deadline - time.monotonic()), 2)
    report["slots_in_use"] = slots
    report["fresh_request_status"], report["window_full"] = await fresh_requests(soaked)
    report["problems"] = idle_problems(report)
    return report


def idle_problems(report: dict[str, Any]) -> list[str]:
    """What an idle engine and gateway must not show."""
    problems = [
        f"{name}: {report[name]}"
        for name in (
            "in_flight_requests",
            "waiting",
            "running",
            "cache_sequences",
            "active_blocks",
            "nonzero_free_blocks",
        )
        if report[name]
    ]
    if report["consistency_error"] is not None:
        problems.append(f"pool inconsistent: {report['consistency_error']}")
    if report["free_blocks"] != report["available_blocks"]:
        problems.append("free blocks and available blocks disagree")
    problems += [
        f"{slug}: {count} slots not back" for slug, count in report["slots_in_use"].items() if count
    ]
    problems += [
        f"{slug}: fresh request answered {status}"
        for slug, status in report["fresh_request_status"].items()
        if status != 200 and slug not in report.get("window_full", [])
    ]
    return problems


async def fresh_requests(soaked: Soaked) -> tuple[dict[str, int | None], list[str]]:
    """One small request per tenant, and the tenants whose request window is still full; a
    rate-limit 429 is waited out (up to 3 tries). A tenant whose flood used its whole request
    window may only be served once that minute has passed: a 429 saying so (no request left,
    a wait within the minute) is no problem; any other 429 (a concurrency slot not given back)
    is."""
    statuses: dict[str, int | None] = {}
    window_full: list[str] = []
    async with http_client(4) as client:
        client.base_url = httpx.URL(soaked.server.url)
        for slug, key in soaked.keys.items():
            body = chat_body([{"role": "user", "content": "ping"}], "fresh", False, 2)
            for attempt in range(3):
                outcome = await send(client, key, slug, body, f"fresh-{slug}-{attempt}")
                statuses[slug] = outcome.status
                if outcome.status != 429:
                    break
                if outcome.window_full and outcome.retry_after_s <= WINDOW_S:
                    window_full.append(slug)
                    break
                await asyncio.sleep(min(outcome.retry_after_s, 2.0))
    return statuses, window_full


def last_audit_seq(state: GatewayState) -> int:
    state.audit.join()
    with state.store.transaction() as session:
        seq: int | None = session.scalar(select(func.max(AuditEvent.seq)))
        return seq or 0


async def audit_check(
    state: GatewayState, after_seq: int, request_ids: list[str]
) -> dict[str, Any]:
    """Exactly one audit event per client request id, `cancelled` or `success`, none 5xx;
    waits (bounded) for events of requests settled just after their clients left."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        events = await asyncio.to_thread(_events_after, state, after_seq)
        by_id = Counter(event["client_request_id"] for event in events)
        if all(by_id[rid] for rid in request_ids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    wanted = set(request_ids)
    mine = [event for event in events if event["client_request_id"] in wanted]
    missing = [rid for rid in request_ids if not by_id[rid]]
    duplicated = [rid for rid in request_ids if by_id[rid] > 1]
    wrong = [
        e for e in mine if e["outcome"] not in ("cancelled", "success") or (e["status"] or 0) >= 500
    ]
    problems = [f"no audit event for {rid}" for rid in missing[:10]]
    problems += [f"{by_id[rid]} audit events for {rid}" for rid in duplicated[:10]]
    problems += [f"audit event {e}" for e in wrong[:10]]
    return {
        "events": len(mine),
        "outcomes": dict(Counter(event["outcome"] for event in mine)),
        "statuses": dict(Counter(str(event["status"]) for event in mine)),
        "missing": len(missing),
        "duplicated": len(duplicated),
        "problems": problems,
    }


def _events_after(state: GatewayState, after_seq: int) -> list[dict[str, Any]]:
    state.audit.join()
    with state.store.transaction() as session:
        rows = session.scalars(select(AuditEvent).where(AuditEvent.seq > after_seq))
        return [
            {
                "client_request_id": row.details.get("client_request_id"),
                "outcome": row.outcome,
                "status": row.details.get("status"),
            }
            for row in rows
        ]
