"""The admin console from a test: Debian's Chromium under Playwright, and a plain HTTP session.

`launch_chromium` drives the system's `chromium` (never a downloaded browser); tests skip with
the reason when it is missing (`.ci/run` installs it). `ConsoleSession` logs in through the
login form as a browser would (CSRF nonce cookie, hidden field), for the tests that check
headers, cookies and refusals without a browser; `form_value` reads a hidden field (a
single-use form's nonce) of one form on a page.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest

from tests.support.gateway import ADMIN_PASSWORD, ADMIN_USER, Gateway

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@contextmanager
def launch_chromium() -> Iterator[Any]:
    """A headless Chromium (the system's) driven by Playwright; skips the test without one."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def csrf_of(page: str) -> str:
    """The CSRF token in a console page's forms."""
    found = _CSRF.search(page)
    assert found is not None, "no CSRF field on the page"
    return found.group(1)


class _FormFields(HTMLParser):
    """The input values of the forms on a page, by the form's action."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: dict[str, dict[str, str]] = {}
        self._action: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "form":
            self._action = named.get("action") or ""
            self.forms.setdefault(self._action, {})
        elif tag == "input" and self._action is not None and named.get("name"):
            self.forms[self._action][named["name"] or ""] = named.get("value") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._action = None


def form_value(page: str, action: str, name: str) -> str:
    """The value of input `name` in the page's form that posts to `action`."""
    parser = _FormFields()
    parser.feed(page)
    assert action in parser.forms, f"no form posts to {action}"
    assert name in parser.forms[action], f"the form to {action} has no {name}"
    return parser.forms[action][name]


class ConsoleSession:
    """An HTTP client on the console with a logged-in session cookie (redirects not followed)."""

    def __init__(
        self, gateway: Gateway, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD
    ) -> None:
        self.client = httpx.Client(base_url=gateway.server.url, timeout=30)
        self.login_response = self.login(username, password)
        assert self.login_response.status_code == 303, self.login_response.text
        self.csrf = csrf_of(self.client.get("/admin/account").text)

    def login(self, username: str, password: str) -> httpx.Response:
        form = self.client.get("/admin/login")
        return self.client.post(
            "/admin/login",
            data={"csrf": csrf_of(form.text), "username": username, "password": password},
        )

    def get(self, path: str, **params: str) -> httpx.Response:
        # An empty `params` would drop a query string written into `path`.
        return self.client.get(path, params=params or None)

    def post(self, path: str, data: dict[str, str], csrf: bool = True) -> httpx.Response:
        """POST a form, with this session's CSRF token unless `csrf` is False."""
        return self.client.post(path, data={**({"csrf": self.csrf} if csrf else {}), **data})

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ConsoleSession:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
