"""GET /v1/models, /healthz, /readyz, /metrics."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from gateway.api.deps import PrincipalDep, StateDep
from gateway.state import GatewayState

router = APIRouter(tags=["system"])
_STARTED = int(time.time())


@router.get("/v1/models")
async def list_models(state: StateDep, _: PrincipalDep) -> dict[str, object]:
    return {
        "object": "list",
        "data": [
            {"id": state.model_name, "object": "model", "created": _STARTED,
             "owned_by": "prefixgate"}
        ],
    }  # fmt: skip


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> Response:
    checks = {"engine": state.engine.running and not state.draining, "database": False}
    try:
        await asyncio.wait_for(run_in_threadpool(_ping, state), timeout=3)
        checks["database"] = True
    except Exception:  # any failure means not ready; the reason is not the client's business
        checks["database"] = False
    ready = all(checks.values())
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks},
                        status_code=200 if ready else 503)  # fmt: skip


def _ping(state: GatewayState) -> None:
    with state.store.engine.connect() as connection:
        connection.execute(text("SELECT 1"))


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
