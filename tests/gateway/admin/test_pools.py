"""/admin/api/pools: after real traffic, the served model's pool lists the tenant with the
engine's blocks and the hit ratio its repeated prompt earned, the public budget's row and the
pool's size; a deleted tenant shows by id, an idle one not at all; a tenant-admin sees each
pool with its own row only, no worker and no other owner; a tenant's usage is split by pool.

The session gateway serves one model ("tiny-chat") with the engine in its own process: one
pool, no workers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from engine.cache.budget import PUBLIC_OWNER
from tests.support.admin import admin_client, login
from tests.support.gateway import MODEL, Gateway

# A private prompt (no registered public prefix) long enough to fill several 16-token blocks.
PROMPT = "Flight PG-{n} leaves from gate 12 at dawn; the crew boards an hour before. " * 8


@dataclass(frozen=True, slots=True)
class Traffic:
    """A tenant made through the admin API, and the usage of the requests its key sent."""

    tenant_id: str
    slug: str
    prompt_tokens: int
    cached_tokens: list[int]


@pytest.fixture(scope="module")
def admin_token(gateway: Gateway) -> str:
    return login(gateway)


def _new_tenant(client: httpx.Client, prefix: str) -> tuple[str, str, str]:
    """A new tenant's id and slug, and an inference key of it."""
    slug = f"{prefix}-{uuid.uuid4().hex[:10]}"
    tenant = client.post("/tenants", json={"slug": slug, "cache_quota_blocks": 64})
    assert tenant.status_code == 201, tenant.text
    tenant_id = tenant.json()["id"]
    key = client.post(f"/tenants/{tenant_id}/keys", json={"name": "pools"})
    assert key.status_code == 201, key.text
    return tenant_id, slug, key.json()["key"]


def _chat(gateway: Gateway, key: str, n: int) -> tuple[int, int]:
    """Send prompt `n` with the key: its prompt tokens, and how many of them were cached."""
    api = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    answer = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT.format(n=n)}],
        max_tokens=2,
        temperature=0,
    )
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


@pytest.fixture(scope="module")
def traffic(gateway: Gateway, admin_token: str) -> Traffic:
    """The same prompt twice (the second is a cached hit) from a new tenant."""
    with admin_client(gateway, admin_token) as client:
        tenant_id, slug, key = _new_tenant(client, "pool")
    usages = [_chat(gateway, key, 1) for _ in range(2)]
    cached = [cached for _, cached in usages]
    assert cached[0] == 0 < cached[1]  # a private prompt: cold, then a hit
    gateway.settled_stats(tenant_id)
    return Traffic(tenant_id, slug, sum(prompt for prompt, _ in usages), cached)


def _pools(client: httpx.Client) -> dict[str, Any]:
    answer = client.get("/pools")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _row(pool: dict[str, Any], owner: str) -> dict[str, Any]:
    rows = [row for row in pool["owners"] if row["owner"] == owner]
    assert len(rows) == 1, (owner, pool["owners"])
    return rows[0]


def test_the_pool_shows_the_tenants_blocks_and_the_hit_ratio_of_a_repeated_prompt(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        listed = _pools(client)
    (pool,) = listed["pools"]
    assert (pool["model"], pool["served"]) == (MODEL, True)
    assert pool["workers"] == [] and listed["workers_without_model"] == []  # in process
    engine = gateway.server.gateway.engine.cache_stats()
    assert (
        pool["total_blocks"] == engine.num_blocks == gateway.server.gateway.engine.pool.num_blocks
    )
    assert 0 <= pool["free_blocks"] <= pool["total_blocks"]
    row = _row(pool, traffic.tenant_id)
    assert (row["tenant_id"], row["slug"]) == (traffic.tenant_id, traffic.slug)
    assert row["prompt_tokens"] == traffic.prompt_tokens
    assert row["cached_tokens"] == sum(traffic.cached_tokens) > 0
    assert row["hit_ratio"] == pytest.approx(sum(traffic.cached_tokens) / traffic.prompt_tokens)
    stats = engine.owners[traffic.tenant_id]
    assert row["cached_blocks"] == stats.cached_blocks > 0  # the prompt's blocks stay cached
    assert row["active_blocks"] == stats.active_blocks == 0  # nothing is running
    assert (row["quota_blocks"], row["reserved_blocks"]) == (64, 0)


def test_the_public_budget_comes_first_and_tenants_follow_by_slug(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        (pool,) = _pools(client)["pools"]
    public = pool["owners"][0]
    assert (public["owner"], public["tenant_id"], public["slug"]) == ("public", None, None)
    engine = gateway.server.gateway.engine.cache_stats().owners[PUBLIC_OWNER]
    assert public["quota_blocks"] == engine.quota_blocks
    assert public["cached_blocks"] == engine.cached_blocks
    slugs = [row["slug"] for row in pool["owners"][1:] if row["slug"] is not None]
    assert slugs == sorted(slugs) and traffic.slug in slugs


def test_a_deleted_tenant_shows_by_its_id(gateway: Gateway, admin_token: str) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id, _, key = _new_tenant(client, "gone")
        _chat(gateway, key, 2)
        gateway.settled_stats(tenant_id)
        assert client.delete(f"/tenants/{tenant_id}").status_code in (200, 204)
        (pool,) = _pools(client)["pools"]
    row = _row(pool, tenant_id)
    assert (row["tenant_id"], row["slug"]) == (tenant_id, None)
    assert row["cached_blocks"] == row["active_blocks"] == 0  # purged with the tenant
    assert row["prompt_tokens"] > 0  # what it did is still counted


def test_a_tenant_that_never_used_the_pool_is_not_listed(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id, _, _ = _new_tenant(client, "idle")
        quota = client.put(f"/tenants/{tenant_id}/quota", json={"quota_blocks": 32})
        assert quota.status_code == 200, quota.text
        # The engine knows its budget now (as every worker knows every tenant's)...
        assert tenant_id in gateway.server.gateway.engine.cache_stats().owners
        (pool,) = _pools(client)["pools"]
    # ...but it holds, reserves and asked for nothing: not one of the pool's users.
    assert tenant_id not in {row["owner"] for row in pool["owners"]}


def test_a_tenant_admin_sees_each_pool_with_its_own_row_only(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        acme = client.get("/tenants", params={"q": "acme"}).json()["data"][0]
    with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as client:
        answer = client.get("/pools")
    assert answer.status_code == 200, answer.text
    listed = answer.json()
    (pool,) = listed["pools"]
    assert pool["model"] == MODEL and pool["total_blocks"] > 0
    assert pool["workers"] is None and listed["workers_without_model"] is None
    assert pool["free_blocks"] is None  # it moves with other tenants' traffic
    (row,) = pool["owners"]
    assert (row["owner"], row["slug"]) == (acme["id"], "acme")
    assert row["quota_blocks"] == acme["cache"]["quota_blocks"]
    assert traffic.tenant_id not in answer.text and traffic.slug not in answer.text
    assert '"public"' not in answer.text


def test_pools_need_an_admin_credential(gateway: Gateway) -> None:
    url = f"{gateway.admin_url}/pools"
    anonymous = httpx.get(url)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    inference = httpx.get(url, headers={"Authorization": f"Bearer {gateway.keys['acme']}"})
    assert inference.status_code == 403


def test_a_tenants_usage_is_split_by_pool(
    gateway: Gateway, admin_token: str, traffic: Traffic
) -> None:
    with admin_client(gateway, admin_token) as client:
        cache = client.get(f"/tenants/{traffic.tenant_id}").json()["cache"]
        (pool,) = _pools(client)["pools"]
    (mine,) = cache["pools"]
    assert mine["model"] == MODEL
    row = _row(pool, traffic.tenant_id)
    same = ("active_blocks", "cached_blocks", "reserved_blocks", "quota_blocks",
            "prompt_tokens", "cached_tokens", "hit_ratio")  # fmt: skip
    assert {name: mine[name] for name in same} == {name: row[name] for name in same}
    # One pool: the totals are that pool's.
    assert {name: cache[name] for name in same} == {name: mine[name] for name in same}
    assert cache["workers"] == []  # no workers in process
