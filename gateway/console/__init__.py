"""The admin console at /admin: server-rendered pages for the people who run PrefixGate.

Operators log in with their username and password and work through plain HTML forms: tenants
(quota bars, hit ratios, a live usage chart), their keys, limits and cache quotas, public
prefixes, each model's KV pool (its workers, and who holds its blocks), operator accounts and
the audit log. The console owns no rules of its own: every read and every change is a call to
the admin service (`gateway/admin/service/`), which the admin API's routes call too, so
validation, audit events and effects on the engine have one home, and the console shows their
answers and their errors as pages.

No front-end build and nothing from a CDN: templates and the few static files (a stylesheet,
the chart's script, the new key's Copy button) ship in this package. `install_console` adds the
pages, the landings for a GET on a form's address, the single-use form nonces, the static files
and the security headers to the app.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from gateway.console import (
    audit_pages,
    form_urls,
    key_pages,
    login_pages,
    operator_pages,
    pool_pages,
    prefix_pages,
    tenant_pages,
    usage_feed,
)
from gateway.console.form_nonces import install_forms
from gateway.console.headers import ConsoleHeaders
from gateway.console.pages import STATIC_DIR

ROUTERS = [
    login_pages.router,
    tenant_pages.router,
    key_pages.router,
    usage_feed.router,
    prefix_pages.router,
    pool_pages.router,
    operator_pages.router,
    audit_pages.router,
    form_urls.router,
]


def install_console(app: FastAPI) -> None:
    """Serve the console under /admin (pages, /admin/static files, security headers)."""
    install_forms(app.state)
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/admin/static", StaticFiles(directory=STATIC_DIR), name="console-static")
    app.add_middleware(ConsoleHeaders)
