"""Security headers on every console response (pages, redirects, errors, static files).

The Content-Security-Policy allows scripts, styles, images and fetches from this origin only,
and no inline script or style at all: an injected `<script>` or `style=""` would not run even if
escaping ever failed. Pages cannot be framed (clickjacking), forms post only here, nothing is
cached (a page may show a secret once) and no URL leaks in a Referer.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


def is_console_path(path: str) -> bool:
    """The console is /admin and below, except the JSON admin API under /admin/api."""
    if path == "/admin/api" or path.startswith("/admin/api/"):
        return False
    return path == "/admin" or path.startswith("/admin/")


class ConsoleHeaders:
    """ASGI middleware: adds `HEADERS` to every response under the console's paths."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_console_path(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, with_headers)
