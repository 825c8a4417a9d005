"""Where a browser lands when it opens a form's address with GET.

A console form posts to an address that only takes POST. The browser can still come to it
with GET: a bookmark, a history entry, an address copied from the bar while an answer to a
POST was showing (a new key's secret is shown on such an answer). Without a GET route that
would be the framework's JSON 405; here it is a redirect (303) to the page the form lives on,
which then asks for a login if needed. Nothing is read or changed on the way, so the landing
needs no session and no CSRF token.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from gateway.console.pages import ConsoleRoute

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

# Each POST-only form address (under /admin) and the page its form lives on.
LANDINGS = {
    "/logout": "/admin",
    "/tenants/{tenant_id}/settings": "/admin/tenants/{tenant_id}",
    "/tenants/{tenant_id}/scheduling": "/admin/tenants/{tenant_id}",
    "/tenants/{tenant_id}/quota": "/admin/tenants/{tenant_id}",
    "/tenants/{tenant_id}/suspend": "/admin/tenants/{tenant_id}/confirm?action=suspend",
    "/tenants/{tenant_id}/resume": "/admin/tenants/{tenant_id}/confirm?action=resume",
    "/tenants/{tenant_id}/delete": "/admin/tenants/{tenant_id}/confirm?action=delete",
    "/tenants/{tenant_id}/keys": "/admin/tenants/{tenant_id}",
    "/tenants/{tenant_id}/keys/{key_id}/revoke": "/admin/tenants/{tenant_id}",
    "/tenants/{tenant_id}/keys/{key_id}/rotate": "/admin/tenants/{tenant_id}",
    "/prefixes/{prefix_id}/enable": "/admin/prefixes",
    "/prefixes/{prefix_id}/disable": "/admin/prefixes",
    "/operators/{operator_id}/enable": "/admin/operators",
    "/operators/{operator_id}/disable": "/admin/operators",
    "/operators/{operator_id}/password": "/admin/operators",
    "/account/password": "/admin/account",
}


def _landing(target: str) -> Callable[[Request], Response]:
    def land(request: Request) -> Response:
        # Path segments are put back quoted: a segment cannot add a query or another path.
        segments = {name: quote(str(value), safe="") for name, value in request.path_params.items()}
        return RedirectResponse(target.format(**segments), status_code=303)

    land.__doc__ = f"A GET on this form's address lands on {target}."
    return land


for _path, _target in LANDINGS.items():
    router.add_api_route(_path, _landing(_target), methods=["GET"], name=f"land {_path}")
