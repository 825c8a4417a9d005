"""Request dependencies as `Annotated` aliases: the gateway state and the request's settlement.

The request gate (gateway/middleware.py) has already checked the API key from the headers
before any route runs; routes read the caller from the settlement it opened.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gateway.settlement import Settlement
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
