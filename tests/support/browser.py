"""The admin console from a test: Debian's Chromium under Playwright, and a plain HTTP session.

`launch_chromium` drives the system's `chromium` (never a downloaded browser); tests skip with
the reason when it is missing (`.ci/run` installs it). `ConsoleSession` logs in through the
login form as a browser would (CSRF nonce cookie, hidden field), for the tests that check
headers, cookies and refusals without a browser; `form_value` reads a hidden field (a
single-use form's nonce) of one form on a page.

The rest check what a person sees on a console page, measured by the browser that laid it
out: where the usage chart's lines end, that a focus ring touches no other field, that no
select cuts its options' text off.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.support.gateway import ADMIN_PASSWORD, ADMIN_USER, Gateway

if TYPE_CHECKING:  # Playwright is imported by the tests that drive a browser (or they skip)
    from playwright.sync_api import Page

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


def chart_end(page: Page, series: str) -> int:
    """The blocks where the blocks chart's `series` line ends (its right edge is now), read
    off the chart's own axis (the gridlines of 0 and of its top, `data-y-max`), to the block."""
    return round(
        page.evaluate(
            """series => {
              const chart = document.querySelector('#usage-chart');
              const grid = chart.querySelectorAll('line.gridline');
              const zero = Number(grid[0].getAttribute('y1'));
              const top = Number(grid[grid.length - 1].getAttribute('y1'));
              const points = chart.querySelector('polyline.' + series).getAttribute('points');
              const last = points.trim().split(' ').pop().split(',').map(Number);
              return (zero - last[1]) / (zero - top) * Number(chart.getAttribute('data-y-max'));
            }""",
            series,
        )
    )


def right_after_a_sample(gateway: Gateway, tenant_id: str) -> None:
    """Return just after the gateway's usage history sampled the tenant: a change made now is
    in no sample until the next one, an interval later."""
    usage = gateway.server.gateway.usage

    def newest() -> float:
        samples = usage.window(tenant_id, 60).samples
        return samples[-1].t if samples else 0.0

    before, deadline = newest(), time.monotonic() + 10
    while newest() == before:
        assert time.monotonic() < deadline, "the usage history took no sample in 10 s"
        time.sleep(0.005)


def assert_no_focus_ring_touches_another_field(page: Page, form: str) -> None:
    """Tab through `form`: the focus ring of each field and button stays clear of every other
    field's label, input and hint (and of the button), as the user sees it."""
    touching = """form => {
      const control = document.activeElement;
      const style = getComputedStyle(control);
      const ring = parseFloat(style.outlineWidth) + parseFloat(style.outlineOffset) + 1;
      const r = control.getBoundingClientRect();
      const own = control.closest('.field') || control;
      const others = [...document.querySelector(form).querySelectorAll(
        'label, input:not([type=hidden]), .hint, .field-error, button')]
        .filter(other => !own.contains(other));
      return others.filter(other => {
        const o = other.getBoundingClientRect();
        return r.left - ring < o.right && o.left < r.right + ring &&
               r.top - ring < o.bottom && o.top < r.bottom + ring;
      }).map(other => control.id + ' touches ' + (other.id || other.textContent.trim()));
    }"""
    controls = page.locator(f"{form} input:not([type=hidden]), {form} button")
    controls.first.focus()
    for index in range(controls.count()):
        assert controls.nth(index).evaluate("control => control === document.activeElement")
        ring = controls.nth(index).evaluate("control => getComputedStyle(control).outlineWidth")
        assert ring != "0px", "a focused control shows no focus ring"
        assert page.evaluate(touching, form) == []
        page.keyboard.press("Tab")


def assert_selects_show_their_options(page: Page) -> None:
    """Every select on the page is at least as wide as a select sized to each of its options'
    text (same styles, laid out by the browser): whichever is chosen, its text is not cut off."""
    clipped = page.evaluate(
        """() => [...document.querySelectorAll('select')].flatMap(select => {
          const shown = select.getBoundingClientRect().width;
          return [...select.options].map(option => {
            const probe = document.createElement('select');
            probe.appendChild(new Option(option.text));
            probe.style.position = 'absolute';
            probe.style.width = 'auto';
            select.parentElement.appendChild(probe);
            const needed = probe.getBoundingClientRect().width;
            probe.remove();
            return needed > shown ? `${select.id} "${option.text}": ${shown}px < ${needed}px` : '';
          }).filter(Boolean);
        })"""
    )
    assert clipped == [], clipped
