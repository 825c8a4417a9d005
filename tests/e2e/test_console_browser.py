"""The admin console in a real browser (Debian's Chromium under Playwright) and over plain HTTP.

The walk is what an operator does on a first day: log in, create a tenant, give it a cache
quota, create a key, watch real traffic arrive on the tenant's live chart, shrink the quota and
see cached blocks go, and export the tenant's audit trail, which `prefixgate audit verify`
checks. Every page it visits is saved as a screenshot under test-artifacts/console/.

The focused tests pin the console's safety promises: a form without its CSRF token changes
nothing; every page carries the CSP and has no inline script or style; the session cookie's
flags; a tenant-admin sees its own tenant only; a hostile display name is shown as text; bad
input gives the form back with a message, never a 500. The rest check each page's forms over
HTTP: paging, confirmation before suspend/resume/delete, a key's secret shown once, rotation
and revocation, public prefixes, operators.

One gateway of its own (so quotas can change freely) and one browser for the whole module.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page, expect
from starlette.requests import Request
from starlette.responses import Response

from gateway.console.headers import CONTENT_SECURITY_POLICY
from gateway.console.pages import format_bytes
from gateway.console.session import set_session_cookie
from tenancy import keys
from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client
from tests.support.browser import ConsoleSession, csrf_of, launch_chromium
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
    context = browser.new_context(base_url=console_gateway.server.url, accept_downloads=True)
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


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def log_in(page: Page, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> None:
    page.goto("/admin/login")
    page.get_by_label("Username", exact=True).fill(username)
    page.get_by_label("Password", exact=True).fill(password)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("header form.logout")).to_be_visible()


def number_in(page: Page, selector: str) -> float:
    text = page.locator(selector).inner_text()
    return float(text.replace(",", "").rstrip("%"))


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
    page.goto("/admin")
    expect(page).to_have_url(re.compile(r"/admin/login\?reason=login$"))
    expect(page).to_have_title(re.compile("^Log in"))
    shot(page, "01-login")
    log_in(page)
    expect(page).to_have_url(re.compile(r"/admin/tenants$"))
    expect(page.locator("#tenants-table")).to_contain_text("acme")
    shot(page, "02-tenants")

    # A tenant, its quota (the page says what it means in bytes) and a key.
    page.get_by_label("Slug", exact=True).fill("walkthrough")
    page.get_by_label("Display name", exact=True).fill("Walkthrough Travel")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.locator(".notice")).to_have_text("Tenant created.")
    tenant_id = page.url.split("?")[0].rsplit("/", 1)[-1]
    page.get_by_label("Quota", exact=True).fill("48")
    page.get_by_label("Reservation", exact=True).fill("4")
    page.get_by_role("button", name="Save quota").click()
    expect(page.locator(".notice")).to_contain_text("Cache quota saved")
    bytes_per_block = console_gateway.server.gateway.engine.pool.spec.bytes_per_block
    expect(page.locator("#quota-meaning")).to_contain_text("48 blocks")
    expect(page.locator("#quota-bytes")).to_have_text(format_bytes(48 * bytes_per_block))
    page.get_by_label("Name", exact=True).fill("booking service")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-key-secret").input_value()
    assert secret.startswith(f"{keys.PREFIX}_")
    shot(page, "03-key-created")
    page.goto(f"/admin/tenants/{tenant_id}")
    assert secret not in page.content()  # shown once, never again
    expect(page.locator("#keys-table")).to_contain_text("booking service")

    # Real traffic with that key; the live chart and the hit ratio follow it.
    client = openai.OpenAI(base_url=console_gateway.base_url, api_key=secret, max_retries=0)
    chat(client, passenger_turns("Ana"))
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
        ".getAttribute('data-points')) > before",
        arg=points_before,
        timeout=LIVE_TIMEOUT_MS,
    )
    expect(page.locator("#live-hit-ratio")).not_to_have_text("0.0%", timeout=LIVE_TIMEOUT_MS)
    assert number_in(page, "#live-hit-ratio") > 0
    expect(page.locator("#live-window-hit-ratio")).not_to_have_text("0.0%")
    expect(page.locator("#live-cached-blocks")).not_to_have_text("0", timeout=LIVE_TIMEOUT_MS)
    cached_before = number_in(page, "#live-cached-blocks")
    assert cached_before > 2, "the traffic should have left several private blocks cached"
    shot(page, "04-tenant-live")

    # Shrinking the quota evicts this tenant's cached blocks at once.
    page.get_by_label("Quota", exact=True).fill("2")
    page.get_by_label("Reservation", exact=True).fill("0")
    page.get_by_role("button", name="Save quota").click()
    expect(page.locator(".notice")).to_contain_text("Cache quota saved")
    assert number_in(page, "#live-cached-blocks") <= 2
    expect(page.locator("#live-quota-blocks")).to_have_text("2", timeout=LIVE_TIMEOUT_MS)
    stats = console_gateway.server.gateway.engine.cache_stats().owners[tenant_id]
    assert stats.cached_blocks <= 2 < cached_before
    shot(page, "05-tenant-quota-shrunk")

    # The other pages an operator uses.
    page.get_by_role("link", name="Public prefixes").click()
    expect(page.locator("#prefixes-table")).to_contain_text("airline")
    shot(page, "06-prefixes")
    page.get_by_role("link", name="Operators").click()
    expect(page.locator("#operators-table")).to_contain_text(ADMIN_USER)
    shot(page, "07-operators")

    # The tenant's audit trail, filtered on the page, downloaded, verified by the CLI.
    console_gateway.server.gateway.audit.join()  # this tenant's request events are written
    page.get_by_role("link", name="Audit log").click()
    expect(page.locator("#chain-status")).to_contain_text("verified")
    page.get_by_label("Tenant", exact=True).select_option(label="walkthrough")
    page.get_by_role("button", name="Apply filters").click()
    expect(page.locator("#audit-table")).to_contain_text("tenant.set_quota")
    shot(page, "08-audit")
    with page.expect_download() as downloading:
        page.locator("#export-jsonl").click()
    exported = tmp_path / downloading.value.suggested_filename
    downloading.value.save_as(exported)
    records = [json.loads(line) for line in exported.read_text().splitlines()]
    events = [record for record in records if record["record"] == "event"]
    assert {event["tenant_id"] for event in events} == {tenant_id}
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
        assert console.get(f"/admin/tenants/{ids['acme']}").status_code == 200
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
            (f"/admin/tenants/{tenant_id}/settings", {"max_concurrent": "1.5"}, 400,
             "settings-max_concurrent", "integer"),
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


def test_a_wrong_password_shows_the_login_form_again(console_gateway: Gateway) -> None:
    with httpx.Client(base_url=console_gateway.server.url) as client:
        form = client.get("/admin/login")
        refused = client.post("/admin/login", data={"csrf": csrf_of(form.text),
                                                   "username": ADMIN_USER,
                                                   "password": "not the password"})  # fmt: skip
        assert refused.status_code == 401
        assert "wrong username or password" in refused.text
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
        assert deleted.headers["location"] == "/admin/tenants?done=tenant_deleted"
        assert status() == "gone"
        assert console.get(page).status_code == 404


def test_a_key_secret_is_shown_once_and_keys_rotate_and_revoke(console_gateway: Gateway) -> None:
    secret_field = re.compile(r'id="new-key-secret"[^>]*value="([^"]+)"')
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        tenant_id = api.post("/tenants", json={"slug": f"k-{uuid.uuid4().hex[:8]}"}).json()["id"]
        keys_page = f"/admin/tenants/{tenant_id}/keys"

        def key_states() -> dict[str, str]:
            return {key["key_id"]: key["state"] for key in api.get(f"/tenants/{tenant_id}/keys")
                    .json()}  # fmt: skip

        created = console.post(keys_page, {"name": "booking service"})
        assert created.status_code == 200
        found = secret_field.search(created.text)
        assert found is not None
        secret = found.group(1)
        (key_id,) = key_states()
        assert key_id in secret
        shown = console.get(f"/admin/tenants/{tenant_id}").text
        assert key_id in shown and secret not in shown and "new-key-secret" not in shown

        rotated = console.post(f"{keys_page}/{key_id}/rotate", {"grace_seconds": "60"})
        assert rotated.status_code == 200
        successor = secret_field.search(rotated.text)
        assert successor is not None and successor.group(1) != secret
        assert key_states()[key_id] == "rotating"
        assert console.post(f"{keys_page}/{key_id}/revoke", {}).status_code == 303
        assert key_states()[key_id] == "revoked"
        again = console.post(f"{keys_page}/{key_id}/rotate", {"grace_seconds": "60"})
        assert again.status_code == 409 and "only an active key rotates" in again.text


def test_public_prefixes_show_their_size_and_are_disabled_and_deleted(
    console_gateway: Gateway,
) -> None:
    name = f"brief-{uuid.uuid4().hex[:6]}"
    with admin_client(console_gateway) as api, ConsoleSession(console_gateway) as console:
        form = {"namespace": "default", "name": name, "text": "Be brief."}
        assert console.post("/admin/prefixes", form).status_code == 303
        listed = console.get("/admin/prefixes").text
        row = listed[listed.index(f'data-prefix="default/{name}"') :].split("</tr>")[0]
        assert "shorter than 2 whole blocks" in row  # the too-short warning
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
