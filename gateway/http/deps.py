"""Request dependencies as `Annotated` aliases: the gateway state, the request's settlement,
and the end user a request names.

For /v1 the request gate (gateway/http/middleware.py) has already checked the API key from the
headers before any route runs; routes read the caller from the settlement it opened. The admin
API's caller is the admin package's own dependency (gateway/admin/deps.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gateway.http.settlement import Settlement
from gateway.state import GatewayState


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def get_settlement(request: Request) -> Settlement:
    settlement: Settlement = request.state.settlement
    return settlement


StateDep = Annotated[GatewayState, Depends(get_state)]
SettlementDep = Annotated[Settlement, Depends(get_settlement)]
UserHeaderDep = Annotated[
    str | None, Header(alias="X-PrefixGate-User", max_length=256, pattern=r"^[^\x00-\x1f]*$")
]
