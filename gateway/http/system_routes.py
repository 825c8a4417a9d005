"""GET /v1/models, /healthz, /readyz, /metrics.

/healthz and /readyz answer anyone, for probes: alive, and ready or not (200 or 503). What
/readyz knows besides (the engine's description, its step cost, workers, where limits are
counted, the audit backlog) describes the deployment, so it is shown only to the scraper: a
caller with `Authorization: Bearer <metrics_token>`, the token that also unlocks /metrics'
per-tenant series. With no metrics token configured nobody sees the details. A wrong token
gets /readyz's short answer, never a 401: a readiness probe must not fail for a header it
carries by accident (an API key in a client's default headers, say); on /metrics it is a 401,
so a misconfigured scraper learns it at once. Two Authorization headers are a 400 everywhere,
here too: no route picks one of them.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from gateway.errors import APIError
from gateway.http.deps import StateDep, single_header
from gateway.http.openapi import API_RESPONSES, error_response
from gateway.state import GatewayState

router = APIRouter(tags=["system"])
_STARTED = int(time.time())
_METRICS_401 = error_response("A metrics token was presented and is wrong")


@router.get("/v1/models", responses=API_RESPONSES)
async def list_models(state: StateDep) -> dict[str, object]:
    """Every model served now (behind workers: every model with a worker in routing)."""
    names = await run_in_threadpool(state.models.names)  # a new model's registry may load
    return {"object": "list", "data": [_model(name) for name in names]}


@router.get(
    "/v1/models/{model_id:path}",
    responses=API_RESPONSES | {404: error_response("No model has this id")},
)
async def get_model(model_id: str, state: StateDep) -> dict[str, object]:
    """One model by id (ids may hold slashes, as `org/name` does)."""
    if await run_in_threadpool(state.models.get, model_id) is None:
        raise APIError.model_not_found(model_id[:256])
    return _model(model_id)


def _model(name: str) -> dict[str, object]:
    return {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "prefixgate",
    }


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def get_authorization(
    request: Request,
    _authorization: Annotated[str | None, Header(alias="Authorization")] = None,
) -> str | None:
    """The Authorization header, if one came (a 400 for two)."""
    return single_header(request.headers, "Authorization")


AuthorizationDep = Annotated[str | None, Depends(get_authorization)]


@router.get(
    "/readyz",
    responses={
        200: {"description": "Ready; the details only with the metrics token"},
        503: {"description": "Not ready (with the metrics token, the checks say which part)"},
    },
)
async def readyz(state: StateDep, authorization: AuthorizationDep) -> Response:
    """`{"status": "ready"}` (200) or `{"status": "not_ready"}` (503); with
    `Authorization: Bearer <metrics token>` also the checks and what serves."""
    checks = {"engine": state.engine.running and not state.draining, "database": False}
    try:
        await asyncio.wait_for(run_in_threadpool(_ping, state), timeout=3)
        checks["database"] = True
    except Exception:  # any failure means not ready; the reason is not the client's business
        checks["database"] = False
    ready = all(checks.values())
    body: dict[str, object] = {"status": "ready" if ready else "not_ready"}
    if authorization is not None and _metrics_token_valid(state, authorization):
        body |= {
            "checks": checks,
            "engine": state.engine.describe(),
            "limits": _limits(state),
            "gateways": state.peers.count,
            # How tenancy changes made elsewhere arrive: notified at once, or by polling alone.
            "tenancy_changes": "notified" if state.tenancy_listener.listening else "polled",
            "audit": await run_in_threadpool(_audit_backlog, state),
        }
    return JSONResponse(body, status_code=200 if ready else 503)


def _limits(state: GatewayState) -> dict[str, object]:
    """Where tenants' limits are kept: shared by every gateway (Redis), or in this process
    alone (no Redis configured, or Redis away: fail-open). A gateway stays ready either way."""
    limiter = state.limiter
    if limiter.shared is None:
        return {
            "store": "process",
            "shared": False,
            "note": "PREFIXGATE_REDIS_URL is unset: with several gateways, each tenant gets "
            "its limits once per gateway",
        }
    if not limiter.shared_now:
        return {
            "store": "process",
            "shared": False,
            "note": "Redis does not answer: limiting in this process until it does (fail-open)",
        }
    return {"store": "redis", "shared": True}


def _audit_backlog(state: GatewayState) -> dict[str, object]:
    """Events waiting for the database, and events it refused (see README: audit log)."""
    log = state.store.audit
    dead = log.dead_letters()
    return {
        "spooled": log.pending(),
        "dead_letters": dead,
        "dead_letter_path": str(log.dead_letter_path) if dead else None,
    }


def _ping(state: GatewayState) -> None:
    with state.store.engine.connect() as connection:
        connection.execute(text("SELECT 1"))


@router.get(
    "/metrics",
    responses={
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}},
        401: _METRICS_401,
    },
)
async def metrics(state: StateDep, authorization: AuthorizationDep) -> Response:
    """Prometheus text; per-tenant series need `Authorization: Bearer <metrics token>`."""
    include_tenants = authorization is not None
    if include_tenants and not _metrics_token_valid(state, authorization or ""):
        raise APIError.unauthorized("invalid metrics token")
    # Off the event loop: the audit gauges read files under locks an audit write may hold.
    body = await run_in_threadpool(state.metrics.exposition, include_tenants)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _metrics_token_valid(state: GatewayState, authorization: str) -> bool:
    token = state.settings.metrics_token
    expected = token.get_secret_value() if token is not None else ""
    scheme, _, presented = authorization.partition(" ")
    return (
        bool(expected)
        and scheme.lower() == "bearer"
        and hmac.compare_digest(presented.strip().encode(), expected.encode())
    )
