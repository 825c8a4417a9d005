"""Request dependencies as `Annotated` aliases: the gateway state, the request's settlement,
and the end user a request names; and `single_header`, the one rule for headers that must
come once.

For /v1 the request gate (gateway/http/middleware.py) has already checked the API key from the
headers before any route runs; routes read the caller from the settlement it opened. The admin
API's caller is the admin package's own dependency (gateway/admin/deps.py).

A credential or identity header sent twice is refused (400, naming the header), never settled
by taking the first or the last: a proxy that adds its own `X-PrefixGate-User` beside the
client's, or a client that smuggles a second `Authorization`, must not leave the gateway to
guess which one is meant.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.datastructures import Headers

from gateway.errors import APIError
from gateway.http.settlement import Settlement
from gateway.state import GatewayState

USER_HEADER = "X-PrefixGate-User"


def single_header(headers: Headers, name: str) -> str | None:
    """The value of header `name` (None without one); a 400 naming it when it came twice."""
    values = headers.getlist(name)
    if len(values) > 1:
        message = f"the {name} header came {len(values)} times; send it once"
        raise APIError.invalid(message, name, "duplicate_header")
    return values[0] if values else None


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def get_settlement(request: Request) -> Settlement:
    settlement: Settlement = request.state.settlement
    return settlement


async def get_user_header(
    request: Request,
    user: Annotated[
        str | None, Header(alias=USER_HEADER, max_length=256, pattern=r"^[^\x00-\x1f]*$")
    ] = None,
) -> str | None:
    """The end user the `X-PrefixGate-User` header names, if it came (once)."""
    single_header(request.headers, USER_HEADER)
    return user


StateDep = Annotated[GatewayState, Depends(get_state)]
SettlementDep = Annotated[Settlement, Depends(get_settlement)]
UserHeaderDep = Annotated[str | None, Depends(get_user_header)]
