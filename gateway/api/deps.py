"""Request dependencies as `Annotated` aliases: the gateway state and the request's settlement.

The request gate (gateway/middleware.py) has already checked the API key from the headers
before any route runs; routes read the caller from the settlement it opened.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gateway.auth import Principal
from gateway.settlement import Settlement
from gateway.state import GatewayState


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def get_settlement(request: Request) -> Settlement:
    settlement: Settlement = request.state.settlement
    return settlement


async def get_principal(settlement: Annotated[Settlement, Depends(get_settlement)]) -> Principal:
    assert settlement.principal is not None  # the gate refuses every /v1 request without one
    return settlement.principal


StateDep = Annotated[GatewayState, Depends(get_state)]
SettlementDep = Annotated[Settlement, Depends(get_settlement)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
UserHeaderDep = Annotated[
    str | None, Header(alias="X-PrefixGate-User", max_length=256, pattern=r"^[^\x00-\x1f]*$")
]
