"""The admin console in a real browser (Debian's Chromium under Playwright) and over plain HTTP.

The walk is what an operator does on a first day: log in, create a tenant, give it a cache
quota, create a key, watch real traffic arrive on the tenant's live chart and keys table,
shrink the quota and see cached blocks go, and export the tenant's audit trail, which
`prefixgate audit verify` checks. On the way it checks what a person saw wrong in a browser:
the login form's fields and button apart, a clean address after a save, the chart's quota
line at the new quota at once and its axis labelled, the keys' "Last used" live, the audit
filter's tenant choice readable and its times in UTC. The browser runs in New York's time zone,
so a time shown in the browser's own zone would not pass for UTC. Every console page the tests
visit is saved as a screenshot under test-artifacts/console/.

The focused tests pin the console's safety promises: a form without its CSRF token changes
nothing; every page carries the CSP and has no inline script or style; the session cookie's
flags; a tenant-admin sees its own tenant only; a hostile display name is shown as text; bad
input gives the form back with a message, never a 500. The rest check each page's forms over
HTTP: paging, confirmation before suspend/resume/delete, a key's secret shown once, rotation
and revocation, public prefixes, operators.

One gateway of its own (so quotas can change freely) and one browser for the whole module.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import openai
import pytest
from fastapi.routing import APIRoute
from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page, expect
from starlette.requests import Request
from starlette.responses import Response

from gateway.console import ROUTERS
from gateway.console.form_nonces import NONCE_FIELD, FormAlreadyUsed, FormExpired, OneTimeForms
from gateway.console.form_urls import LANDINGS
from gateway.console.headers import CONTENT_SECURITY_POLICY
from gateway.console.pages import format_bytes
from gateway.console.session import set_session_cookie
from tenancy import key_format
from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client
from tests.support.browser import (
    ConsoleSession,
    assert_no_focus_ring_touches_another_field,
    assert_selects_show_their_options,
    chart_end,
    csrf_of,
    form_value,
    launch_chromium,
    right_after_a_sample,
)
from tests.support.cli import Cli
from tests.support.gateway import (
    ADMIN_PASSWORD,
    ADMIN_USER,
    JWT_SECRET,
    KEY_SECRET,
    MODEL,
    SIGNING_KEY,
    SYSTEM_PROMPT,
    Gateway,
    start_gateway,
)

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
LIVE_TIMEOUT_MS = 30_000  # samples every 0.5 s, the chart refreshes every 2 s; CI is slow
OPERATOR_PASSWORD = "a long enough password"
BROWSER_ZONE = "America/New_York"  # never UTC: a time in the browser's zone would show it
UTC_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")  # as the console writes times


@pytest.fixture(scope="module")
def console_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    state_dir = tmp_path_factory.mktemp("console-state")
    tenants = [("acme", "user", TenantLimits()), ("globex", "user", TenantLimits())]
    with start_gateway(migrated_template, tiny_chat_dir, state_dir, tenants,
                       usage_sample_s=0.5,
                       admin_login_attempts_per_minute=1000) as started:  # fmt: skip
        yield started


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser, console_gateway: Gateway) -> Iterator[Page]:
    """A fresh browser context (no cookies) on the console; the test fails if a script opens a
    dialog (an injected alert) or the page logs an error (a CSP violation, a script error)."""
    context = browser.new_context(
        base_url=console_gateway.server.url,
        accept_downloads=True,
        timezone_id=BROWSER_ZONE,
        locale="en-US",
    )
    opened = context.new_page()
    dialogs: list[str] = []
    errors: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(message.text)

    opened.on("dialog", on_dialog)
    opened.on("console", on_console)
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    context.close()
    assert dialogs == [], f"a script opened a dialog: {dialogs}"
    assert errors == [], f"the page logged errors (a CSP violation?): {errors}"


def shot(page: Page, name: str) -> Path:
    """Save the whole page as test-artifacts/console/`name`.png (this run's, never a stale one)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    path.unlink(missing_ok=True)
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0, path
    return path


def log_in(page: Page, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> None:
    page.goto("/admin/login")
    page.get_by_label("Username", exact=True).fill(username)
    page.get_by_label("Password", exact=True).fill(password)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("header form.logout")).to_be_visible()


def number_in(page: Page, selector: str) -> float:
    text = page.locator(selector).inner_text()
    return float(text.replace(",", "").rstrip("%"))


def y_ticks(page: Page) -> list[int]:
    """The blocks chart's y-axis labels, which must be round numbers 1, 2 or 5 x 10^k apart."""
    labels = page.locator("#usage-chart text.tick-y").all_text_contents()
    ticks = [int(label.replace(",", "")) for label in labels]
    steps = {later - earlier for earlier, later in itertools.pairwise(ticks)}
    assert ticks[0] == 0 and len(steps) == 1, labels
    (step,) = steps
    assert re.fullmatch(r"[125]0*", str(step)), labels
    return ticks


def seconds_apart(shown: datetime, moment: datetime) -> float:
    return abs((shown - moment).total_seconds())


def assert_steps(points: str) -> None:
    """Every segment of a polyline is level or vertical: a step chart, no slanted ramps."""
    xy = [tuple(map(float, point.split(","))) for point in points.split()]
    for (x0, y0), (x1, y1) in itertools.pairwise(xy):
        assert x0 == x1 or y0 == y1, f"a slanted segment {x0},{y0} -> {x1},{y1} in {points}"


def chat(client: openai.OpenAI, turns: list[str]) -> None:
    """One conversation, a turn at a time: the shared system prompt, then private turns."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})


def passenger_turns(name: str) -> list[str]:
    return [
        f"Hello, my name is {name}. I booked flight EX{len(name)}42 from Lisbon to Oslo on the "
        "fourteenth and I would like to move it to the morning flight if there is a seat left.",
        "Also, can I bring a folding bicycle as checked luggage, and what would that cost me?",
        "Thank you. Please confirm the new time and the total price before changing anything.",
    ]


def test_operator_walks_the_console_from_login_to_a_verified_audit_export(
    console_gateway: Gateway, page: Page, tmp_path: Path
) -> None:
    started = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    page.goto("/admin")
    expect(page).to_have_url(re.compile(r"/admin/login\?reason=login$"))
    expect(page).to_have_title(re.compile("^Log in"))
    expect(page.locator(".notice")).to_have_text("Log in to continue.")
    expect(page.locator(".notice")).to_have_class("notice info")  # neutral, not a success
    # Each field (label, input, hint) stands apart from the next and from the button: a focus
    # ring never runs into the field below or above it.
    assert_no_focus_ring_touches_another_field(page, "form[action='/admin/login']")
    shot(page, "01-login")
    log_in(page)
    expect(page).to_have_url(re.compile(r"/admin/tenants$"))
    expect(page.locator("#tenants-table")).to_contain_text("acme")
    assert_selects_show_their_options(page)
    shot(page, "02-tenants")

    # A tenant, its quota (the page says what it means in bytes) and a key.
    page.get_by_label("Slug", exact=True).fill("walkthrough")
    page.get_by_label("Display name", exact=True).fill("Walkthrough Travel")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.locator(".notice")).to_have_text("Tenant created.")
    expect(page).to_have_url(re.compile(r"/admin/tenants/[0-9a-f-]{36}$"))  # no ?done=
    tenant_id = page.url.rsplit("/", 1)[-1]
    block_size = console_gateway.server.gateway.engine.pool.spec.block_size
    page.get_by_label("Quota", exact=True).fill("48")
    page.get_by_label("Reservation", exact=True).fill(str(4 * block_size))
    page.get_by_label("Reservation unit", exact=True).select_option("tokens")
    page.get_by_role("button", name="Save quota").click()
    expect(page.locator(".notice")).to_contain_text("Cache quota saved")
    # The address is the tenant's page, nothing more; the form stays in the units it was in.
    expect(page).to_have_url(re.compile(rf"/admin/tenants/{tenant_id}$"))
    expect(page.get_by_label("Reservation unit", exact=True)).to_have_value("tokens")
    assert_selects_show_their_options(page)  # the key's role, the units: whole
    expect(page.get_by_label("Reservation", exact=True)).to_have_value(str(4 * block_size))
    bytes_per_block = console_gateway.server.gateway.engine.pool.spec.bytes_per_block
    expect(page.locator("#quota-meaning")).to_contain_text("48 blocks")
    expect(page.locator("#quota-meaning")).to_contain_text("Reservation: 4 blocks")
    expect(page.locator("#quota-bytes")).to_have_text(format_bytes(48 * bytes_per_block))
    # A reload shows the page, not the save again: no notice, and nothing was sent.
    saved = console_gateway.last_audit_seq()
    page.reload()
    expect(page.locator("#quota-meaning")).to_contain_text("48 blocks")
    expect(page.locator(".notice")).to_have_count(0)
    expect(page).to_have_url(re.compile(rf"/admin/tenants/{tenant_id}$"))
    assert [e.action for e in console_gateway.audit_events(saved)] == []
    page.get_by_label("Name", exact=True).fill("booking service")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-key-secret").input_value()
    assert secret.startswith(f"{key_format.PREFIX}_")
    # Copy puts the secret on the clipboard; the address is the tenant's page again, not the
    # form's POST, so a reload posts nothing (and the secret is gone: shown once).
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.get_by_role("button", name="Copy").click()
    expect(page.locator("#copy-status")).to_have_text("Copied to the clipboard.")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    expect(page).to_have_url(re.compile(rf"/admin/tenants/{tenant_id}$"))
    shot(page, "03-key-created")
    page.reload()
    assert secret not in page.content()
    expect(page.locator("#keys-table")).to_contain_text("booking service")
    expect(page.locator("#keys-table tbody tr")).to_have_count(1)
    last_used = page.locator("#keys-table td.last-used")
    expect(last_used).to_have_text("—")  # never used yet
    expect(page.locator("#live-hit-ratio")).to_have_text("—")  # no prompt yet: no ratio

    # Real traffic with that key; the live chart and the hit ratio follow it.
    client = openai.OpenAI(base_url=console_gateway.base_url, api_key=secret, max_retries=0)
    chat(client, passenger_turns("Ana"))
    # The keys table is live too: the key's first use shows without a reload, in UTC.
    expect(last_used).to_have_text(UTC_TIME, timeout=LIVE_TIMEOUT_MS)
    with admin_client(console_gateway) as api:
        (key,) = api.get(f"/tenants/{tenant_id}/keys").json()
    used_at = datetime.fromisoformat(key["last_used_at"]).astimezone(UTC)
    expect(last_used).to_have_text(used_at.strftime("%Y-%m-%d %H:%M:%S UTC"))
    cached_line = page.locator("#usage-chart polyline.series-cached")
    expect(cached_line).not_to_have_attribute("data-points", "0", timeout=LIVE_TIMEOUT_MS)
    points_before = int(cached_line.get_attribute("data-points") or 0)
    for name in ("Ana", "Bruno", "Chen"):
        chat(client, passenger_turns(name))
    expect(page.locator("#hit-chart")).not_to_have_attribute(
        "data-samples", "0", timeout=LIVE_TIMEOUT_MS
    )
    page.wait_for_function(
        "before => Number(document.querySelector('#usage-chart polyline.series-cached')"
        "?.getAttribute('data-points')) > before",
        arg=points_before,
        timeout=LIVE_TIMEOUT_MS,
    )
    for ratio in ("#live-hit-ratio", "#live-window-hit-ratio"):
        page.wait_for_function(
            "id => parseFloat(document.querySelector(id).textContent) > 0",
            arg=ratio,
            timeout=LIVE_TIMEOUT_MS,
        )
    expect(page.locator("#live-cached-blocks")).not_to_have_text("0", timeout=LIVE_TIMEOUT_MS)
    cached_before = number_in(page, "#live-cached-blocks")
    assert cached_before > 2, "the traffic should have left several private blocks cached"
    # The y-axis fits the quota now (48 blocks: 0 to 50 by tens), not the 1,024 blocks the
    # tenant was created with, nor twice anything.
    expect(page.locator("#usage-chart")).to_have_attribute("data-y-max", "50")
    assert y_ticks(page) == [0, 10, 20, 30, 40, 50]
    # The axes say what they count; the title sits left of the tick labels, inside the chart.
    for chart, unit in (("#usage-chart", "blocks"), ("#hit-chart", "hit ratio")):
        title = page.locator(f"{chart} text.axis-title")
        expect(title).to_have_text(unit)
        box, frame = title.bounding_box(), page.locator(chart).bounding_box()
        ticks = [tick.bounding_box() for tick in page.locator(f"{chart} text.tick-y").all()]
        assert box is not None and frame is not None and all(ticks)
        assert frame["x"] <= box["x"] and box["x"] + box["width"] <= min(
            tick["x"] for tick in ticks if tick is not None
        ), (unit, box, ticks)
    # The refresh time is the server's, in UTC (the browser's clock is New York's).
    expect(page.locator("#chart-status")).to_have_text(re.compile(r"last at \d\d:\d\d:\d\d UTC\.$"))
    status = page.locator("#chart-status").inner_text()
    at = re.search(r"(\d\d):(\d\d):(\d\d) UTC", status)
    assert at is not None
    now = datetime.now(UTC)
    shown = now.replace(hour=int(at.group(1)), minute=int(at.group(2)), second=int(at.group(3)))
    assert min(seconds_apart(shown + timedelta(days=d), now) for d in (-1, 0, 1)) < 60, status
    shot(page, "04-tenant-live")

    # Shrinking the quota evicts this tenant's cached blocks at once. Saved just after the
    # usage history's sample, the first drawing of the page after the save already ends the
    # quota line at the new quota (what the card above says), not at the sample's old one.
    page.get_by_label("Quota", exact=True).fill("2")
    page.get_by_label("Reservation", exact=True).fill("0")
    right_after_a_sample(console_gateway, tenant_id)
    page.get_by_role("button", name="Save quota").click()
    expect(page.locator(".notice")).to_contain_text("Cache quota saved")
    expect(page.locator("#live-quota-blocks")).to_have_text("2")
    expect(page.locator("#usage-chart")).not_to_have_attribute("data-samples", "0")  # drawn
    assert chart_end(page, "series-quota") == 2
    assert chart_end(page, "series-reserved") == 0
    assert number_in(page, "#live-cached-blocks") <= 2
    expect(page.locator("#live-quota-blocks")).to_have_text("2", timeout=LIVE_TIMEOUT_MS)
    stats = console_gateway.server.gateway.engine.cache_stats().owners[tenant_id]
    assert stats.cached_blocks <= 2 < cached_before
    # The quota's drop is a step (level, then straight down), and the axis now fits the
    # window's cached blocks, which were more than the new quota.
    quota_line = page.locator("#usage-chart polyline.series-quota")
    # The live feed redraws the chart: between two draws the line may not be there yet.
    page.wait_for_function(
        "() => { const line = document.querySelector('#usage-chart polyline.series-quota');"
        " if (!line) return false;"
        " const p = line.getAttribute('points').split(' ').map(xy => xy.split(',').map(Number));"
        " return p.some((xy, i) => i > 0 && xy[0] === p[i - 1][0] && xy[1] > p[i - 1][1]); }",
        timeout=LIVE_TIMEOUT_MS,
    )
    assert_steps(quota_line.get_attribute("points") or "")
    assert cached_before <= y_ticks(page)[-1] <= 50
    shot(page, "05-tenant-quota-shrunk")

    # The other pages an operator uses.
    page.get_by_role("link", name="Suspend…").click()
    expect(page.locator("#confirm-action")).to_have_text("Yes, suspend walkthrough")
    shot(page, "05b-tenant-confirm")
    page.get_by_role("link", name="Public prefixes").click()
    expect(page.locator("#prefixes-table")).to_contain_text("airline")
    shot(page, "06-prefixes")
    page.get_by_role("link", name="Delete default/airline").click()
    expect(page.locator("#confirm-action")).to_have_text("Yes, delete it")
    shot(page, "06b-prefix-delete")
    page.get_by_role("link", name="Operators").click()
    expect(page.locator("#operators-table")).to_contain_text(ADMIN_USER)
    assert_selects_show_their_options(page)
    shot(page, "07-operators")
    page.get_by_role("link", name="My account", exact=True).click()
    expect(page.get_by_label("Current password", exact=True)).to_be_visible()
    shot(page, "07b-account")
    # In a page of its own: the browser logs the 404 as an error, which `page` would refuse.
    missing = page.context.new_page()
    missing.goto(f"/admin/tenants/{uuid.uuid4()}")
    expect(missing.locator("h1")).to_have_text("Not found (404)")
    shot(missing, "07c-not-found")
    missing.close()

    # The tenant's audit trail, filtered on the page, downloaded, verified by the CLI.
    console_gateway.server.gateway.audit.join()  # this tenant's request events are written
    page.get_by_role("link", name="Audit log").click()
    expect(page.locator("#chain-status")).to_contain_text("verified")
    expect(page.get_by_label("Tenant", exact=True)).to_have_value("")
    assert_selects_show_their_options(page)  # "All tenants and global events", whole
    page.get_by_label("Tenant", exact=True).select_option(label="walkthrough")
    # The times are UTC as the labels say, whatever the browser's zone: a time typed with
    # New York's offset comes back as the same moment written in UTC, as the table writes it.
    since = page.get_by_label("From (UTC)", exact=True)
    expect(since).to_have_attribute("type", "text")  # not the browser's local date picker
    since.fill(started.astimezone(ZoneInfo(BROWSER_ZONE)).isoformat())
    page.get_by_role("button", name="Apply filters").click()
    expect(since).to_have_value(started.strftime("%Y-%m-%d %H:%M:%S UTC"))
    expect(page.locator("#audit-table")).to_contain_text("tenant.set_quota")
    newest = page.locator("#audit-table tr.event td").nth(1).inner_text()
    assert UTC_TIME.match(newest.replace("\n", " ")), newest
    shown = datetime.strptime(newest.replace("\n", " "), "%Y-%m-%d %H:%M:%S UTC")
    assert seconds_apart(shown.replace(tzinfo=UTC), datetime.now(UTC)) < 300, newest
    shot(page, "08-audit")
    with page.expect_download() as downloading:
        page.locator("#export-jsonl").click()
    exported = tmp_path / downloading.value.suggested_filename
    downloading.value.save_as(exported)
    records = [json.loads(line) for line in exported.read_text().splitlines()]
    events = [record for record in records if record["record"] == "event"]
    assert {event["tenant_id"] for event in events} == {tenant_id}
    assert min(datetime.fromisoformat(event["time"]) for event in events) >= started
    actions = {event["action"] for event in events}
    assert {"tenant.create", "tenant.set_quota", "api_key.create", "inference.chat"} <= actions
    runner = Cli(console_gateway.database_url, tmp_path / "cli-state")
    runner.env.update(PREFIXGATE_KEY_HASH_SECRET=KEY_SECRET,
                      PREFIXGATE_AUDIT_SIGNING_KEY=SIGNING_KEY,
                      PREFIXGATE_JWT_SECRET=JWT_SECRET)  # fmt: skip
    assert runner.ok("audit", "verify", str(exported)).strip() == (
        f"ok: {len(events)} events verified"
    )

    # Logging out ends the session: the console sends the browser back to the login page.
    page.get_by_role("button", name="Log out").click()
    expect(page.locator(".notice")).to_have_text("You are logged out.")
    expect(page.locator(".notice")).to_have_class("notice info")
    page.goto(f"/admin/tenants/{tenant_id}")
    expect(page).to_have_url(re.compile(r"/admin/login\?reason=login$"))


def test_a_hostile_display_name_is_shown_as_text(console_gateway: Gateway, page: Page) -> None:
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    slug = f"x-{uuid.uuid4().hex[:8]}"
    with admin_client(console_gateway) as api:
        answer = api.post("/tenants", json={"slug": slug, "display_name": hostile})
        assert answer.status_code == 201, answer.text
        tenant_id = answer.json()["id"]
    log_in(page)
    page.goto(f"/admin/tenants?q={slug}")
    expect(page.locator("#tenants-table")).to_contain_text(hostile)
    assert page.locator("script").count() == 0
    page.goto(f"/admin/tenants/{tenant_id}")
    expect(page.locator("h1")).to_contain_text(hostile)
    scripts = page.locator("script")
    assert scripts.count() == 1 and scripts.get_attribute("src") == "/admin/static/chart.js"
    assert page.locator("img[src=x]").count() == 0
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.content()


def test_a_form_without_the_csrf_token_is_refused_and_changes_nothing(
    console_gateway: Gateway,
) -> None:
    with admin_client(console_gateway) as api:
        tenant = api.post("/tenants", json={"slug": f"c-{uuid.uuid4().hex[:8]}",
                                            "cache_quota_blocks": 40}).json()  # fmt: skip

        def quota() -> int:
            blocks: int = api.get(f"/tenants/{tenant['id']}").json()["quota"]["blocks"]
            return blocks

        before = console_gateway.last_audit_seq()
        with ConsoleSession(console_gateway) as console, ConsoleSession(console_gateway) as other:
            path = f"/admin/tenants/{tenant['id']}/quota"
            form = {"quota": "8", "quota_unit": "blocks"}
            missing = console.post(path, form, csrf=False)
            assert missing.status_code == 403
            assert "nothing was changed" in missing.text
            foreign = console.post(path, {**form, "csrf": other.csrf}, csrf=False)
            assert foreign.status_code == 403
            assert quota() == 40
            assert not [e for e in console_gateway.audit_events(before)
                        if e.action == "tenant.set_quota"]  # fmt: skip
            assert console.post(path, form).status_code == 303  # the same form, with its token
            assert quota() == 8
    # The login form is protected too (double submit: its nonce cookie and hidden field).
    with httpx.Client(base_url=console_gateway.server.url) as browserless:
        refused = browserless.post(
            "/admin/login", data={"username": ADMIN_USER, "password": ADMIN_PASSWORD}
        )
        assert refused.status_code == 403
        assert "pg_admin" not in refused.headers.get("set-cookie", "")


class _InlineCode(HTMLParser):
    """Collects what a strict CSP would block: inline scripts, style attributes and elements,
    event-handler attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if tag == "script":
            self._in_script = True
            if "src" not in names:
                self.found.append("<script> without src")
        if tag == "style":
            self.found.append("<style>")
        self.found += [f"{tag}[{name}]" for name in names if name == "style" or
                       name.startswith("on")]  # fmt: skip

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.found.append("inline script text")


def test_every_page_sends_the_csp_and_has_no_inline_script_or_style(
    console_gateway: Gateway,
) -> None:
    with admin_client(console_gateway) as api:
        tenant_id = api.get("/tenants", params={"q": "acme"}).json()["data"][0]["id"]
        prefix_id = api.get("/prefixes").json()[0]["id"]
    pages = [
        "/admin/login",
        "/admin/tenants",
        f"/admin/tenants/{tenant_id}",
        f"/admin/tenants/{tenant_id}/confirm?action=delete",
        "/admin/prefixes",
        f"/admin/prefixes/{prefix_id}/delete",
        "/admin/pools",
        "/admin/operators",
        "/admin/account",
        "/admin/audit",
        f"/admin/tenants/{uuid.uuid4()}",  # a 404 page
    ]
    with ConsoleSession(console_gateway) as console:
        for path in [*pages, f"/admin/tenants/{tenant_id}/usage.json", "/admin/static/chart.js"]:
            answer = console.client.get(path)
            assert answer.status_code in (200, 404), (path, answer.status_code)
            assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
            assert answer.headers["x-content-type-options"] == "nosniff", path
            assert answer.headers["referrer-policy"] == "no-referrer", path
            assert answer.headers["cache-control"] == "no-store", path
            if path in pages:
                assert answer.headers["content-type"].startswith("text/html"), path
                parser = _InlineCode()
                parser.feed(answer.text)
                assert parser.found == [], (path, parser.found)
                assert "<title>" in answer.text, path
        redirect = console.client.get("/admin")  # redirects carry the headers too
        assert redirect.status_code == 303
        assert redirect.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert (
            "content-security-policy" not in console.client.get("/admin/api/tenants").headers
        )  # the JSON API is not the console


def test_the_session_cookie_is_httponly_strict_scoped_and_lives_as_the_token(
    console_gateway: Gateway,
) -> None:
    with ConsoleSession(console_gateway) as console:
        cookie = next(value for value in console.login_response.headers.get_list("set-cookie")
                      if value.startswith("pg_admin="))  # fmt: skip
        flags = {part.strip().split("=")[0].lower(): part.strip() for part in cookie.split(";")}
        assert "httponly" in flags
        assert flags["samesite"].lower() == "samesite=strict"
        assert flags["path"] == "Path=/admin"
        assert "secure" not in flags  # this console was reached over plain http
        ttl = console_gateway.server.gateway.settings.admin_token_ttl_s
        assert ttl - 5 <= int(flags["max-age"].split("=")[1]) <= ttl
        token = cookie.split(";")[0].split("=", 1)[1]
        logged_out = console.post("/admin/logout", {})
        assert logged_out.status_code == 303
        assert 'pg_admin=""' in logged_out.headers["set-cookie"]
        # The session is revoked, not only forgotten: the old cookie is worthless.
        replay = httpx.get(f"{console_gateway.server.url}/admin/tenants",
                           cookies={"pg_admin": token})  # fmt: skip
        assert replay.status_code == 303
        assert replay.headers["location"] == "/admin/login?reason=expired"


def test_the_session_cookie_is_secure_when_the_console_is_reached_over_https() -> None:
    response = Response()
    scope = {"type": "http", "scheme": "https", "server": ("console.example", 443),
             "path": "/admin/login", "headers": []}  # fmt: skip
    set_session_cookie(Request(scope), response, "token", datetime.now(UTC) + timedelta(minutes=5))
    assert "secure" in response.headers["set-cookie"].lower()


def test_the_pools_page_shows_the_pool_its_owners_and_a_tenants_hit_ratio(
    console_gateway: Gateway, page: Page
) -> None:
    slug = f"p-{uuid.uuid4().hex[:8]}"
    with admin_client(console_gateway) as api:
        tenant_id = api.post("/tenants", json={"slug": slug}).json()["id"]
        secret = api.post(f"/tenants/{tenant_id}/keys", json={"name": "pools"}).json()["key"]
    # Each turn sends the conversation so far again: the later turns hit the cache.
    chat(openai.OpenAI(base_url=console_gateway.base_url, api_key=secret, max_retries=0),
         passenger_turns("Dora"))  # fmt: skip
    stats = console_gateway.settled_stats(tenant_id)
    assert stats.counters.reuse > 0 and stats.cached_blocks > 0
    log_in(page)
    nav = page.get_by_role("navigation", name="Main")
    nav.get_by_role("link", name="Pools").click()
    expect(page).to_have_url(re.compile(r"/admin/pools$"))
    expect(page).to_have_title(re.compile("^Pools"))
    expect(nav.get_by_role("link", name="Pools")).to_have_attribute("aria-current", "page")
    pool = page.locator(f'section[data-model="{MODEL}"]')
    expect(pool.get_by_role("heading", level=2)).to_have_text(f"{MODEL} served")
    expect(pool.get_by_text("Served by this gateway's own engine (no workers).")).to_be_visible()
    owners = pool.get_by_role("table", name=f"Who holds blocks of {MODEL}")
    expect(owners.get_by_role("columnheader")).to_have_count(8)
    expect(owners.locator("tbody tr").first).to_have_attribute("data-owner", "public")
    row = owners.locator(f'tr[data-owner="{tenant_id}"]')
    expect(row.get_by_role("rowheader")).to_have_text(slug)
    expect(row.locator(".cached-blocks")).to_have_text(f"{stats.cached_blocks:,}")
    expect(row.locator(".quota-blocks")).to_have_text(f"{stats.quota_blocks:,}")
    expect(row.locator(".hit-ratio")).to_have_text(f"{100 * stats.counters.reuse:.1f}%")
    shot(page, "09-pools")
    # The tenant's own page splits its usage by pool the same way, and keeps it live.
    row.get_by_role("link", name=slug).click()
    expect(page).to_have_url(re.compile(rf"/admin/tenants/{tenant_id}$"))
    mine = page.locator(f'#pool-cache tr[data-model="{MODEL}"]')
    expect(mine.locator(".hit-ratio")).to_have_text(f"{100 * stats.counters.reuse:.1f}%")
    prompts = mine.locator('[data-field="prompt_tokens"]')
    expect(prompts).to_have_text(f"{stats.counters.prompt_tokens:,}")
    chat(openai.OpenAI(base_url=console_gateway.base_url, api_key=secret, max_retries=0),
         passenger_turns("Dora"))  # fmt: skip
    later = console_gateway.settled_stats(tenant_id).counters
    expect(prompts).to_have_text(f"{later.prompt_tokens:,}", timeout=LIVE_TIMEOUT_MS)
    expect(mine.locator(".hit-ratio")).to_have_text(f"{100 * later.reuse:.1f}%")
    expect(page.locator("#live-prompt-tokens")).to_have_text(f"{later.prompt_tokens:,}")


def test_a_tenant_admin_operator_sees_its_own_row_in_each_pool(console_gateway: Gateway) -> None:
    username = f"acme-pools-{uuid.uuid4().hex[:6]}"
    with ConsoleSession(console_gateway) as admin:
        created = admin.post("/admin/operators", {"username": username, "role": "tenant-admin",
                                                  "password": OPERATOR_PASSWORD,
                                                  "tenant": "acme"})  # fmt: skip
        assert created.status_code == 303, created.text
        assert 'href="/admin/pools"' in admin.get("/admin/tenants").text  # in an admin's nav
    with ConsoleSession(console_gateway, username, OPERATOR_PASSWORD) as console:
        answer = console.get("/admin/pools")
        assert answer.status_code == 200
        owners = re.findall(r'<tr data-owner="([^"]+)">', answer.text)
        with admin_client(console_gateway) as api:
            acme_id = api.get("/tenants", params={"q": "acme"}).json()["data"][0]["id"]
        assert owners == [acme_id]
        assert "globex" not in answer.text and "Public budget" not in answer.text
        assert '<table class="workers"' not in answer.text
        assert 'href="/admin/pools"' not in answer.text  # not in a tenant-admin's nav


def test_a_tenant_admin_operator_sees_only_its_own_tenant(console_gateway: Gateway) -> None:
    username = f"acme-ops-{uuid.uuid4().hex[:6]}"
    with admin_client(console_gateway) as api:
        ids = {row["slug"]: row["id"] for row in api.get("/tenants").json()["data"]}
    with ConsoleSession(console_gateway) as admin:  # an admin creates it on the operators page
        created = admin.post("/admin/operators", {"username": username, "role": "tenant-admin",
                                                  "password": OPERATOR_PASSWORD,
                                                  "tenant": "acme"})  # fmt: skip
        assert created.status_code == 303, created.text
        assert username in admin.get("/admin/operators").text
    with ConsoleSession(console_gateway, username, OPERATOR_PASSWORD) as console:
        home = console.get("/admin")
        assert home.headers["location"] == f"/admin/tenants/{ids['acme']}"
        own_page = console.get(f"/admin/tenants/{ids['acme']}")
        assert own_page.status_code == 200
        # Its share of the engine's service would tell it what every other tenant got.
        assert "live-window-service-share" not in own_page.text
        own_usage = console.get(f"/admin/tenants/{ids['acme']}/usage.json").json()
        assert own_usage["summary"]["service_share"] is None
        for path in (f"/admin/tenants/{ids['globex']}",
                     f"/admin/tenants/{ids['globex']}/usage.json",
                     f"/admin/audit?tenant={ids['globex']}"):  # fmt: skip
            other = console.get(path)
            assert other.status_code == 404, path
            assert "globex" not in other.text
        listed = console.get("/admin/tenants").text
        assert "acme" in listed and "globex" not in listed
        assert console.get("/admin/prefixes").status_code == 403
        assert console.get("/admin/operators").status_code == 403
        globex_key = console.post(f"/admin/tenants/{ids['globex']}/keys", {"name": "sneaky"})
        assert globex_key.status_code == 404


def test_bad_input_gives_the_form_back_with_a_message(console_gateway: Gateway) -> None:
    with admin_client(console_gateway) as api:
        tenant_id = api.get("/tenants", params={"q": "globex"}).json()["data"][0]["id"]
    with ConsoleSession(console_gateway) as console:
        cases = [
            ("/admin/tenants", {"slug": "s" * 20_000}, 400, "create-slug", "at most 63"),
            ("/admin/tenants", {"display_name": "no slug"}, 400, "create-slug", "required"),
            ("/admin/tenants", {"slug": "acme"}, 409, None, "already exists"),
            ("/admin/tenants", {"slug": "q", "cache_quota_blocks": "lots"}, 400,
             "create-cache_quota_blocks", "valid integer"),
            (f"/admin/tenants/{tenant_id}/quota", {"quota": "-3"}, 400, "quota-quota",
             "greater than or equal to 0"),
            (f"/admin/tenants/{tenant_id}/quota", {"quota": "9" * 40}, 400, "quota-quota", ""),
            (f"/admin/tenants/{tenant_id}/quota", {"reservation": "5000000"}, 400,
             "quota-reservation", ""),
            (f"/admin/tenants/{tenant_id}/settings", {"display_name": "globex",
                                                      "max_concurrent": "1.5"}, 400,
             "settings-max_concurrent", "integer"),
            (f"/admin/tenants/{tenant_id}/settings", {"display_name": " "}, 400,
             "settings-display_name", "required"),
            (f"/admin/tenants/{tenant_id}/scheduling", {"scheduling_weight": ""}, 400,
             "scheduling-scheduling_weight", "required"),
            (f"/admin/tenants/{tenant_id}/scheduling", {}, 400,
             "scheduling-scheduling_weight", "required"),
            (f"/admin/tenants/{tenant_id}/scheduling", {"scheduling_weight": "0"}, 400,
             "scheduling-scheduling_weight", "greater than or equal to 0.01"),
            (f"/admin/tenants/{tenant_id}/scheduling", {"scheduling_weight": "heavy"}, 400,
             "scheduling-scheduling_weight", "valid number"),
            (f"/admin/tenants/{tenant_id}/keys", {"name": "k", "role": "root"}, 400,
             "key-role", ""),
            (f"/admin/tenants/{tenant_id}/keys", {"name": "k", "expires_at": "soon"}, 400,
             "key-expires_at", ""),
            ("/admin/operators", {"username": "x", "password": "short"}, 400,
             "operator-password", "12 characters"),
            ("/admin/operators", {"username": "y", "password": OPERATOR_PASSWORD,
                                  "role": "tenant-admin", "tenant": "nope"}, 400,
             "operator-tenant", "no tenant"),
            ("/admin/prefixes", {"name": "p", "namespace": "default"}, 400, "prefix-text", ""),
            (f"/admin/tenants/{uuid.uuid4()}/quota", {"quota": "3"}, 404, None, "no tenant"),
            ("/admin/tenants/not-a-uuid/quota", {"quota": "3"}, 404, None, "no such page"),
        ]  # fmt: skip
        for path, form, status, field, message in cases:
            if path.endswith("/keys"):  # a single-use form: it needs its nonce from the page
                nonce = form_value(console.get(path.removesuffix("/keys")).text, path, NONCE_FIELD)
                form = {**form, NONCE_FIELD: nonce}
            answer = console.post(path, form)
            assert answer.status_code == status, (path, form, answer.status_code)
            assert answer.headers["content-type"].startswith("text/html")
            assert "Traceback" not in answer.text
            if field is not None:  # the message sits by the field, tied to it for screen readers
                match = re.search(rf'<p class="field-error" id="{field}-error">([^<]*)</p>',
                                  answer.text)  # fmt: skip
                assert match is not None, (path, form, answer.text[:3000])
                assert message in match.group(1)
                assert f'aria-describedby="{field}-hint {field}-error"' in answer.text or (
                    f'aria-describedby="{field}-error"' in answer.text
                )
            else:
                assert message in answer.text.lower() or message in answer.text
        assert console.get("/admin/tenants", page="x").status_code == 400
        assert console.get("/admin/audit", since="yesterday").status_code == 400
        # Out of range once in UTC, or a bare number: the field's error on the page, never a
        # 500 (a time zone offset took 9999-12-31 past the year 9999).
        for since in ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+05:00", "1733500000"):
            for path in ("/admin/audit", "/admin/audit/export"):
                answer = console.get(path, since=since)
                assert answer.status_code == 400, (path, since, answer.text[:300])
                assert "text/html" in answer.headers["content-type"], (path, since)
    with admin_client(console_gateway) as api:  # an empty weight was refused, not a no-op
        assert api.get(f"/tenants/{tenant_id}").json()["scheduling_weight"] == 1.0


def test_the_tenant_page_sets_the_weight_and_shows_the_share_of_service_it_gets(
    console_gateway: Gateway, page: Page
) -> None:
    with admin_client(console_gateway) as api:
        tenant_id = api.post("/tenants", json={"slug": f"w-{uuid.uuid4().hex[:8]}"}).json()["id"]
        key = api.post(f"/tenants/{tenant_id}/keys", json={"name": "weighted"}).json()["key"]
    log_in(page)
    page.goto(f"/admin/tenants/{tenant_id}")
    expect(page.locator("#tenant-weight")).to_have_text("1")
    expect(page.locator("#live-window-service-share")).to_have_text("—")  # nothing served yet
    after = console_gateway.last_audit_seq()
    page.get_by_label("Scheduling weight", exact=True).fill("2.3456789")
    page.get_by_role("button", name="Save weight").click()
    expect(page.locator(".notice")).to_contain_text("Scheduling weight saved")
    # Shown as saved, not rounded: the form saved again unchanged must not change the weight.
    expect(page.locator("#tenant-weight")).to_have_text("2.3456789")
    expect(page.get_by_label("Scheduling weight", exact=True)).to_have_value("2.3456789")
    with admin_client(console_gateway) as api:
        assert api.get(f"/tenants/{tenant_id}").json()["scheduling_weight"] == 2.3456789
    changes = [e for e in console_gateway.audit_events(after) if e.action == "tenant.update"]
    audited = [(e.actor_id, e.details["after"]["scheduling_weight"]) for e in changes]
    assert audited == [(ADMIN_USER, 2.3456789)]
    client = openai.OpenAI(base_url=console_gateway.base_url, api_key=key, max_retries=0)
    chat(client, passenger_turns("Grace"))
    # The page's live refresh shows the share of the engine's service the tenant got.
    expect(page.locator("#live-window-service-share")).to_have_text(
        re.compile(r"^\d+\.\d%$"), timeout=LIVE_TIMEOUT_MS
    )
    assert 0 < number_in(page, "#live-window-service-share") <= 100
    shot(page, "tenant-scheduling")


def test_a_wrong_password_shows_the_login_form_again(console_gateway: Gateway) -> None:
    with httpx.Client(base_url=console_gateway.server.url) as client:
        form = client.get("/admin/login")
        refused = client.post("/admin/login", data={"csrf": csrf_of(form.text),
                                                   "username": ADMIN_USER,
                                                   "password": "not the password"})  # fmt: skip
        assert refused.status_code == 401
        assert "wrong username, password or one-time code" in refused.text
        assert 'value="root"' in refused.text and "not the password" not in refused.text
        assert "pg_admin" not in refused.headers.get("set-cookie", "")


def test_the_tenants_table_searches_and_pages(console_gateway: Gateway) -> None:
    tag = f"pg{uuid.uuid4().hex[:6]}"
    with admin_client(console_gateway) as api:
        for number in range(27):
            assert api.post("/tenants", json={"slug": f"{tag}-{number:02}"}).status_code == 201
    with ConsoleSession(console_gateway) as console:
        first = console.get("/admin/tenants", q=tag).text
        assert first.count(f'data-slug="{tag}-') == 25
        # No traffic: no hit ratio to show (not 0.0%); the columns say their window.
        assert first.count('<td class="number hit-ratio">—</td>') == 25
        assert "0.0%" not in first
        assert "Prompt tokens <small>(last 15 min)</small>" in first
        assert "27 tenants" in first and "Page 1 of 2" in first and 'rel="next"' in first
        second = console.get("/admin/tenants", q=tag, page="2").text
        assert second.count(f'data-slug="{tag}-') == 2 and f"{tag}-26" in second
        assert (
            console.get("/admin/tenants", q="no-such-tenant-anywhere").text.count("data-slug=") == 0
        )


def test_suspend_resume_and_delete_ask_first(console_gateway: Gateway) -> None:
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        tenant_id = api.post("/tenants", json={"slug": f"s-{uuid.uuid4().hex[:8]}"}).json()["id"]
        page = f"/admin/tenants/{tenant_id}"

        def status() -> str:
            answer = api.get(f"/tenants/{tenant_id}")
            return "gone" if answer.status_code == 404 else str(answer.json()["status"])

        unconfirmed = console.post(f"{page}/suspend", {})
        assert unconfirmed.headers["location"] == f"{page}/confirm?action=suspend"
        assert status() == "active"
        question = console.get(unconfirmed.headers["location"])
        assert question.status_code == 200 and "keys stop working" in question.text
        assert console.post(f"{page}/suspend", {"confirmed": "yes"}).status_code == 303
        assert status() == "suspended"
        assert console.post(f"{page}/resume", {"confirmed": "yes"}).status_code == 303
        assert status() == "active"
        deleted = console.post(f"{page}/delete", {"confirmed": "yes"})
        assert deleted.headers["location"] == "/admin/tenants"
        assert "Tenant deleted" in console.get("/admin/tenants").text
        assert status() == "gone"
        assert console.get(page).status_code == 404


def test_a_key_secret_is_shown_once_and_keys_rotate_and_revoke(console_gateway: Gateway) -> None:
    secret_field = re.compile(r'id="new-key-secret"[^>]*value="([^"]+)"')
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        tenant_id = api.post("/tenants", json={"slug": f"k-{uuid.uuid4().hex[:8]}"}).json()["id"]
        tenant_page = f"/admin/tenants/{tenant_id}"
        keys_page = f"{tenant_page}/keys"

        def key_states() -> dict[str, str]:
            return {key["key_id"]: key["state"] for key in api.get(f"/tenants/{tenant_id}/keys")
                    .json()}  # fmt: skip

        nonce = form_value(console.get(tenant_page).text, keys_page, NONCE_FIELD)
        created = console.post(keys_page, {"name": "booking service", NONCE_FIELD: nonce})
        assert created.status_code == 200
        assert created.headers["cache-control"] == "no-store"  # the secret is never cached
        found = secret_field.search(created.text)
        assert found is not None
        secret = found.group(1)
        (key_id,) = key_states()
        assert key_id in secret
        shown = console.get(tenant_page).text
        assert key_id in shown and secret not in shown and "new-key-secret" not in shown

        rotate = f"{keys_page}/{key_id}/rotate"
        other_tab = console.get(tenant_page).text  # its own rotate form, not sent yet
        rotated = console.post(
            rotate, {"grace_seconds": "60", NONCE_FIELD: form_value(shown, rotate, NONCE_FIELD)}
        )
        assert rotated.status_code == 200
        successor = secret_field.search(rotated.text)
        assert successor is not None and successor.group(1) != secret
        assert key_states()[key_id] == "rotating"
        assert console.post(f"{keys_page}/{key_id}/revoke", {}).status_code == 303
        assert key_states()[key_id] == "revoked"
        again = console.post(
            rotate, {"grace_seconds": "60", NONCE_FIELD: form_value(other_tab, rotate, NONCE_FIELD)}
        )
        assert again.status_code == 409 and "only an active key rotates" in again.text


def test_a_key_form_posted_again_makes_no_second_key(console_gateway: Gateway) -> None:
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        tenant_id = api.post("/tenants", json={"slug": f"n-{uuid.uuid4().hex[:8]}"}).json()["id"]
        tenant_page = f"/admin/tenants/{tenant_id}"
        keys_page = f"{tenant_page}/keys"

        def keys_made() -> list[dict[str, Any]]:
            return list(api.get(f"/tenants/{tenant_id}/keys").json())

        form = {"name": "reloaded", NONCE_FIELD: form_value(console.get(tenant_page).text,
                                                             keys_page, NONCE_FIELD)}  # fmt: skip
        assert console.post(keys_page, form).status_code == 200
        (made,) = keys_made()
        # The reload of that answer (the browser posts the same form again).
        repeated = console.post(keys_page, form)
        assert repeated.status_code == 409
        assert "new-key-secret" not in repeated.text
        notice = re.search(r'id="key-repeated"[^>]*>([^<]*)<', repeated.text)
        assert notice is not None
        assert f"Key {made['key_id']} “reloaded” was already created by this form" in notice.group(
            1
        )
        assert "its secret is not shown again" in notice.group(1)
        assert len(keys_made()) == 1
        # A nonce this gateway never handed out (or forgot), or none at all: nothing is made.
        for nonce in ("made-up", ""):
            refused = console.post(keys_page, {"name": "forged", NONCE_FIELD: nonce})
            assert refused.status_code == 409 and "This form has expired" in refused.text
            assert 'value="forged"' in refused.text  # the form comes back, to be sent again
        assert len(keys_made()) == 1
        # A refused form may be corrected and sent again with the same nonce.
        nonce = form_value(console.get(tenant_page).text, keys_page, NONCE_FIELD)
        bad = console.post(keys_page, {"name": "x", "role": "root", NONCE_FIELD: nonce})
        assert bad.status_code == 400 and len(keys_made()) == 1
        assert console.post(keys_page, {"name": "fixed", NONCE_FIELD: nonce}).status_code == 200
        assert len(keys_made()) == 2
        # A nonce works for its own form only: the create form's cannot rotate a key.
        rotate = f"{keys_page}/{made['key_id']}/rotate"
        nonce = form_value(console.get(tenant_page).text, keys_page, NONCE_FIELD)
        crossed = console.post(rotate, {"grace_seconds": "0", NONCE_FIELD: nonce})
        assert crossed.status_code == 409 and len(keys_made()) == 2
        # Rotation, posted twice, makes one successor.
        nonce = form_value(console.get(tenant_page).text, rotate, NONCE_FIELD)
        form = {"grace_seconds": "60", NONCE_FIELD: nonce}
        assert console.post(rotate, form).status_code == 200
        assert console.post(rotate, form).status_code == 409
        assert len(keys_made()) == 3


def test_one_time_forms_forget_old_nonces_and_stay_bounded() -> None:
    now = [0.0]
    forms = OneTimeForms(capacity=3, ttl_s=60, clock=lambda: now[0])
    old = forms.issue("create-key:t")
    now[0] = 61
    with pytest.raises(FormExpired), forms.single_use(old, "create-key:t"):
        pass
    nonces = [forms.issue("create-key:t") for _ in range(4)]
    assert len(forms) == 3  # the oldest went first
    with pytest.raises(FormExpired), forms.single_use(nonces[0], "create-key:t"):
        pass
    now[0] = 100
    with forms.single_use(nonces[3], "create-key:t") as claim:
        claim.made = "Key k1"
    now[0] = 131  # a used nonce is remembered a full TTL from its use, not from its issue
    with pytest.raises(FormExpired), forms.single_use(nonces[2], "create-key:t"):
        pass
    with pytest.raises(FormAlreadyUsed) as used, forms.single_use(nonces[3], "create-key:t"):
        pass
    assert used.value.made == "Key k1"
    with pytest.raises(FormExpired), forms.single_use(nonces[3], "rotate-key:t:k1"):
        pass  # a nonce works for its own form only


def test_public_prefixes_show_their_size_and_are_disabled_and_deleted(
    console_gateway: Gateway,
) -> None:
    name = f"brief-{uuid.uuid4().hex[:6]}"
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        form = {"namespace": "default", "name": name, "text": "Be brief."}
        added = console.post("/admin/prefixes", form)
        assert added.status_code == 303
        assert added.headers["location"] == "/admin/prefixes"  # the flash is in a cookie
        listed = console.get(added.headers["location"]).text
        # Added, but not shared: the flash is a warning that says why, and so is its state.
        flash = re.search(r'<p class="notice ([a-z]+)" role="status">([^<]*)</p>', listed)
        assert flash is not None and flash.group(1) == "warning", listed[:2000]
        assert f"default / {name} added, but it will not be shared" in flash.group(2)
        assert "whole blocks of 16, and a prefix is shared from 2 blocks (32 tokens)" in (
            flash.group(2)
        )
        assert "includes the chat template&#39;s system turn" in listed  # near the form
        row = listed[listed.index(f'data-prefix="default/{name}"') :].split("</tr>")[0]
        assert "shorter than 2 whole blocks" in row  # the too-short warning
        assert '<span class="status unshared">enabled, not shared (too short)</span>' in row
        airline = listed[listed.index('data-prefix="default/airline"') :].split("</tr>")[0]
        assert '<span class="status enabled">enabled</span>' in airline
        prefix = next(p for p in api.get("/prefixes").json() if p["name"] == name)
        assert f'<td class="number">{prefix["tokens"]}</td>' in row
        assert prefix["blocks"] == 0 and '<td class="number">0</td>' in row

        def enabled() -> bool | None:
            rows = [p for p in api.get("/prefixes").json() if p["name"] == name]
            return bool(rows[0]["enabled"]) if rows else None

        assert console.post(f"/admin/prefixes/{prefix['id']}/disable", {}).status_code == 303
        assert enabled() is False
        assert console.post(f"/admin/prefixes/{prefix['id']}/enable", {}).status_code == 303
        assert enabled() is True
        unconfirmed = console.post(f"/admin/prefixes/{prefix['id']}/delete", {})
        assert unconfirmed.headers["location"] == f"/admin/prefixes/{prefix['id']}/delete"
        assert enabled() is True
        assert console.post(f"/admin/prefixes/{prefix['id']}/delete",
                            {"confirmed": "yes"}).status_code == 303  # fmt: skip
        assert enabled() is None


def test_operators_are_disabled_and_get_new_passwords(console_gateway: Gateway) -> None:
    username = f"ops-{uuid.uuid4().hex[:6]}"
    new_password = "another long password"
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as admin:
        form = {"username": username, "password": OPERATOR_PASSWORD, "role": "admin"}
        assert admin.post("/admin/operators", form).status_code == 303
        operator_id = next(o["id"] for o in api.get("/operators").json()
                           if o["username"] == username)  # fmt: skip
        with ConsoleSession(console_gateway, username, OPERATOR_PASSWORD) as them:
            mismatch = them.post("/admin/account/password",
                                 {"password": new_password, "password_again": "typo"})  # fmt: skip
            assert mismatch.status_code == 400 and "account-password_again-error" in mismatch.text
            short = admin.post(f"/admin/operators/{operator_id}/password", {"password": "short"})
            assert short.status_code == 400 and "12 characters" in short.text
            changed = admin.post(f"/admin/operators/{operator_id}/password",
                                 {"password": new_password})  # fmt: skip
            assert changed.status_code == 303
            assert them.get("/admin/tenants").headers["location"].endswith("reason=expired")
        with ConsoleSession(console_gateway, username, new_password) as them:
            assert admin.post(f"/admin/operators/{operator_id}/disable", {}).status_code == 303
            assert them.get("/admin/tenants").headers["location"].endswith("reason=expired")
            refused = them.login(username, new_password)
            assert refused.status_code == 403 and "disabled" in refused.text
        assert admin.post(f"/admin/operators/{operator_id}/enable", {}).status_code == 303


def test_my_account_asks_for_the_current_password(console_gateway: Gateway) -> None:
    username = f"me-{uuid.uuid4().hex[:6]}"
    new_password = "my brand new password"
    with ConsoleSession(console_gateway) as admin:
        form = {"username": username, "password": OPERATOR_PASSWORD, "role": "admin"}
        assert admin.post("/admin/operators", form).status_code == 303
        # An operator's own row on the operators page sends it to "My account".
        assert 'href="/admin/account">Change your password' in admin.get("/admin/operators").text
    with ConsoleSession(console_gateway, username, OPERATOR_PASSWORD) as me:
        page = me.get("/admin/account").text
        field = re.search(r'<input id="account-current_password"[^>]*>', page)
        assert field is not None
        assert 'type="password"' in field.group(0) and "required" in field.group(0)
        assert 'autocomplete="current-password"' in field.group(0)
        assert '<label for="account-current_password">Current password</label>' in page
        change = {"password": new_password, "password_again": new_password}
        for current in ("not my password", ""):
            refused = me.post("/admin/account/password", {**change, "current_password": current})
            assert refused.status_code == 400
            error = re.search(r'id="account-current_password-error">([^<]*)<', refused.text)
            assert error is not None and "current password is wrong" in error.group(1)
        # Taken as typed (a password may end with a space), then the password changes.
        changed = me.post("/admin/account/password",
                          {**change, "current_password": OPERATOR_PASSWORD})  # fmt: skip
        assert changed.status_code == 303
        assert changed.headers["location"] == "/admin/account"
        assert "Password changed" in me.get("/admin/account").text
    with ConsoleSession(console_gateway, username, new_password) as me:
        assert me.get("/admin/account").status_code == 200


def test_a_get_on_any_form_address_lands_on_the_page_of_its_form(console_gateway: Gateway) -> None:
    routes = [r for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)]
    posted = {route.path for route in routes if "POST" in (route.methods or set())}
    got = {route.path for route in routes if "GET" in (route.methods or set())}
    assert posted - got == set(), "a POST-only console address would answer a GET with a 405"
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        tenant_id = api.post("/tenants", json={"slug": f"g-{uuid.uuid4().hex[:8]}"}).json()["id"]
        key_id = api.post(f"/tenants/{tenant_id}/keys", json={"name": "k"}).json()["key_id"]
        ids = {
            "tenant_id": tenant_id,
            "key_id": key_id,
            "prefix_id": api.get("/prefixes").json()[0]["id"],
            "operator_id": api.get("/operators").json()[0]["id"],
        }
        keys_before = len(api.get(f"/tenants/{tenant_id}/keys").json())
        for path in sorted(posted):
            address = path.format(**ids)
            landed = console.client.get(address, follow_redirects=True)
            assert landed.status_code == 200, (address, landed.status_code)
            assert landed.headers["content-type"].startswith("text/html"), address
            landing = LANDINGS.get(path.removeprefix("/admin"))
            if landing is not None:  # else the address has a page of its own (the form's)
                hop = console.client.get(address)
                assert hop.status_code == 303, address
                assert hop.headers["location"] == landing.format(**ids), address
        assert len(api.get(f"/tenants/{tenant_id}/keys").json()) == keys_before
        assert console.get("/admin/account").status_code == 200  # a GET logged nobody out
    # Without a session, the landing page asks for a login, as any page does.
    anonymous = httpx.get(f"{console_gateway.server.url}/admin/tenants/{tenant_id}/keys",
                          follow_redirects=True)  # fmt: skip
    assert anonymous.status_code == 200 and "Log in to continue." in anonymous.text


def test_a_quota_saved_in_tokens_comes_back_in_tokens(console_gateway: Gateway) -> None:
    block_size = console_gateway.server.gateway.engine.pool.spec.block_size
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        tenant_id = api.post("/tenants", json={"slug": f"u-{uuid.uuid4().hex[:8]}"}).json()["id"]
        form = {"quota": "1000", "quota_unit": "tokens", "reservation": "2",
                "reservation_unit": "blocks"}  # fmt: skip
        saved = console.post(f"/admin/tenants/{tenant_id}/quota", form)
        assert saved.status_code == 303
        # What was done, and in which units, goes to the next page in a cookie, not the address.
        assert saved.headers["location"] == f"/admin/tenants/{tenant_id}"
        elsewhere = console.get("/admin/tenants").text  # the flash is the tenant page's only
        assert "Cache quota saved" not in elsewhere
        saved = console.post(f"/admin/tenants/{tenant_id}/quota", form)
        page = console.get(saved.headers["location"]).text
        assert "Cache quota saved" in page
        reloaded = console.get(saved.headers["location"]).text  # shown once
        assert "Cache quota saved" not in reloaded
        assert '<option value="blocks" selected>' in reloaded.split('id="quota-quota_unit"')[1]
        quota_blocks = -(-1000 // block_size)  # rounded up to whole blocks
        assert api.get(f"/tenants/{tenant_id}").json()["quota"]["blocks"] == quota_blocks
        quota = re.search(r'<input id="quota-quota"[^>]*value="([^"]*)"', page)
        assert quota is not None and quota.group(1) == str(quota_blocks * block_size)
        assert '<option value="tokens" selected>' in page.split('id="quota-quota_unit"')[1]
        reservation = re.search(r'<input id="quota-reservation"[^>]*value="([^"]*)"', page)
        assert reservation is not None and reservation.group(1) == "2"
        assert '<option value="blocks" selected>' in page.split('id="quota-reservation_unit"')[1]
        # A flash the gateway did not sign (set by a sibling site, say) is ignored: no notice.
        forged = base64.urlsafe_b64encode(b"page=/admin/tenants&done=tenant_created").decode()
        for value in (forged, f"{forged}.{'0' * 64}"):
            console.client.cookies.set("pg_flash", value, path="/admin")
            assert "Tenant created." not in console.get("/admin/tenants").text
        console.client.cookies.delete("pg_flash", path="/admin")


def test_audit_rows_show_missing_values_as_dashes_and_details_full_width(
    console_gateway: Gateway,
) -> None:
    with ConsoleSession(console_gateway) as console:
        assert console.get("/admin/audit/export", format="jsonl").status_code == 200
        console_gateway.server.gateway.audit.join()
        page = console.get("/admin/audit", action="audit.export").text
        first = page.index('<tr data-seq="')
        row = page[first : page.index("</tr>", first)]
        assert "audit.export" in row and "audit_log" in row
        assert "None" not in row
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        assert cells[3] == "—"  # an export of every tenant's events names no tenant
        # The details sit in a row of their own under the event, across the table.
        seq = re.search(r'data-seq="(\d+)"', row)
        assert seq is not None
        details = page[page.index(f'data-details-of="{seq.group(1)}"') :].split("</tr>")[0]
        assert '<td colspan="6"><details>' in details and '"format": "jsonl"' in details
    assert re.search(r"\bNone\b", page) is None
