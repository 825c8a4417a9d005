"""/admin/api usage: after real traffic with a tenant's own key, its usage shows cached blocks and
the window's requests, the audit log's totals count every request and token (a range that has
no time in UTC is a 400 naming its bound), and a tenant-admin sees its own tenant's usage
only."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
import openai
import pytest

from gateway.admin.callers import AdminCaller
from gateway.admin.service.usage import usage_totals
from gateway.errors import APIError
from tests.support.admin import admin_client, login
from tests.support.gateway import MODEL, SYSTEM_PROMPT, Gateway

# Long enough to fill several 16-token blocks of the tenant's own (private) cache.
PRIVATE_TURN = "My booking reference is QX7-{n}. " * 12 + "Which seat do I have?"


@dataclass(frozen=True, slots=True)
class Traffic:
    """A tenant made through the admin API, the requests its key sent, and their usage."""

    tenant_id: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    started: datetime
    finished: datetime


@pytest.fixture(scope="module")
def admin_token(gateway: Gateway) -> str:
    """One admin session for the module (logins are throttled per address)."""
    return login(gateway)


@pytest.fixture(scope="module")
def traffic(gateway: Gateway, admin_token: str) -> Iterator[Traffic]:
    """Three chats (the second repeats the first: cached) and one refused request."""
    started = datetime.now(UTC)
    with admin_client(gateway, admin_token) as client:
        tenant = client.post("/tenants", json={"slug": f"u-{uuid.uuid4().hex[:10]}"})
        assert tenant.status_code == 201, tenant.text
        tenant_id = tenant.json()["id"]
        key = client.post(f"/tenants/{tenant_id}/keys", json={"name": "traffic"})
        assert key.status_code == 201, key.text
    api = openai.OpenAI(base_url=gateway.base_url, api_key=key.json()["key"], max_retries=0)
    usages, cached = [], []
    for n in (1, 1, 2):
        answer = api.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": PRIVATE_TURN.format(n=n)},
            ],
            max_tokens=4,
            temperature=0,
            user="traveller",
        )
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        usages.append(answer.usage)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[1] > 0  # the repeat hit the cache
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    gateway.audit_events()  # the audit writer has caught up
    yield Traffic(
        tenant_id=tenant_id,
        requests=4,
        errors=1,
        prompt_tokens=sum(usage.prompt_tokens for usage in usages),
        cached_tokens=sum(cached),
        completion_tokens=sum(usage.completion_tokens for usage in usages),
        started=started,
        finished=datetime.now(UTC),
    )


def sampled_usage(client: httpx.Client, tenant_id: str, since: datetime) -> dict[str, Any]:
    """The tenant's usage once the gateway's sampler has run after `since`."""
    deadline = time.monotonic() + 15
    while True:
        answer = client.get(f"/tenants/{tenant_id}/usage", params={"window_s": 900})
        assert answer.status_code == 200, answer.text
        usage: dict[str, Any] = answer.json()
        times = [datetime.fromisoformat(sample["time"]) for sample in usage["samples"]]
        if (times and times[-1] > since) or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def test_usage_shows_the_tenants_cached_blocks_now_and_over_the_window(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        usage = sampled_usage(client, traffic.tenant_id, traffic.finished)
    assert usage["cache"]["cached_blocks"] > 0, usage["cache"]
    engine = gateway.server.gateway.engine.cache_stats().owners[traffic.tenant_id]
    assert usage["cache"]["quota_blocks"] == engine.quota_blocks
    assert usage["cache"]["cached_tokens"] == traffic.cached_tokens
    samples = usage["samples"]
    assert samples and samples[-1]["cached_blocks"] > 0
    assert samples[-1]["quota_blocks"] == engine.quota_blocks
    times = [datetime.fromisoformat(sample["time"]) for sample in samples]
    assert times == sorted(times) and times[0] >= traffic.started - timedelta(seconds=5)
    assert all(s["hit_ratio"] is None or 0 <= s["hit_ratio"] <= 1 for s in samples)
    assert usage["interval_s"] == gateway.server.gateway.usage.interval_s
    assert usage["window_s"] == 900


def test_a_new_tenants_first_requests_count_in_the_window(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    # Every request of this tenant happened inside the window, so the window holds them all,
    # even those made before the sampler first saw the tenant.
    with admin_client(gateway, admin_token) as client:
        summary = sampled_usage(client, traffic.tenant_id, traffic.finished)["summary"]
    assert (summary["requests"], summary["errors"]) == (traffic.requests, traffic.errors)
    assert summary["prompt_tokens"] == traffic.prompt_tokens
    assert summary["prefill_tokens_saved"] == traffic.cached_tokens
    assert summary["hit_ratio"] == pytest.approx(traffic.cached_tokens / traffic.prompt_tokens)


def test_the_usage_table_has_a_row_per_tenant(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        page = client.get("/usage", params={"limit": 500}).json()
    rows = {row["tenant_id"]: row for row in page["data"]}
    assert {"acme", "globex"} <= {row["slug"] for row in page["data"]}
    row = rows[traffic.tenant_id]
    assert row["cache"]["cached_blocks"] > 0
    engine = gateway.server.gateway.engine.cache_stats().owners[traffic.tenant_id]
    assert row["cache"]["quota_blocks"] == engine.quota_blocks
    assert set(row["summary"]) >= {"hit_ratio", "requests", "errors", "prefill_tokens_saved"}
    assert page["total"] >= len(page["data"]) and page["window_s"] == 900


def test_totals_from_the_audit_log_count_every_request_and_token(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        answer = client.get(f"/tenants/{traffic.tenant_id}/usage/totals")
        assert answer.status_code == 200, answer.text
        totals = answer.json()
        assert (totals["requests"], totals["errors"]) == (traffic.requests, traffic.errors)
        assert totals["prompt_tokens"] == traffic.prompt_tokens
        assert totals["cached_tokens"] == traffic.cached_tokens > 0
        assert totals["completion_tokens"] == traffic.completion_tokens
        assert totals["hit_ratio"] == pytest.approx(traffic.cached_tokens / traffic.prompt_tokens)
        before = {"until": traffic.started.isoformat()}
        empty = client.get(f"/tenants/{traffic.tenant_id}/usage/totals", params=before).json()
        assert (empty["requests"], empty["prompt_tokens"]) == (0, 0)
        too_long = {"since": (traffic.started - timedelta(days=91)).isoformat()}
        refused = client.get(f"/tenants/{traffic.tenant_id}/usage/totals", params=too_long)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "since"


def test_a_tenant_admin_sees_its_own_usage_and_no_other(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as acme:
        rows = acme.get("/usage").json()["data"]
        assert [row["slug"] for row in rows] == ["acme"]
        acme_id = rows[0]["tenant_id"]
        assert acme.get(f"/tenants/{acme_id}/usage").status_code == 200
        assert acme.get(f"/tenants/{acme_id}/usage/totals").status_code == 200
        for path in ("usage", "usage/totals"):
            other = acme.get(f"/tenants/{traffic.tenant_id}/{path}")
            assert other.status_code == 404, path
            assert other.json()["error"]["code"] == "not_found"
            missing = acme.get(f"/tenants/{uuid.uuid4()}/{path}")
            assert missing.json()["error"]["message"].startswith("no tenant with id")


@pytest.mark.parametrize(
    ("since", "until", "param"),
    [
        (None, datetime(1, 1, 1, tzinfo=UTC), "until"),  # no default start 30 days before
        (datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))), None, "since"),  # year 0
        (None, datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-14))), "until"),
    ],
)
def test_totals_over_a_range_without_a_time_in_utc_are_a_400_naming_it(
    gateway: Gateway,
    admin_token: str,
    traffic: Traffic,
    since: datetime | None,
    until: datetime | None,
    param: str,
) -> None:
    # The HTTP edge already refuses such years; the function the console calls refuses too.
    caller = AdminCaller("admin", None, "operator", "root")
    state = gateway.server.gateway
    with pytest.raises(APIError) as refused:
        usage_totals(state, caller, uuid.UUID(traffic.tenant_id), since, until)
    assert (refused.value.status, refused.value.param) == (400, param)
    bounds = {"since": since, "until": until}
    query = {name: value.isoformat() for name, value in bounds.items() if value is not None}
    with admin_client(gateway, admin_token) as client:
        answer = client.get(f"/tenants/{traffic.tenant_id}/usage/totals", params=query)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
