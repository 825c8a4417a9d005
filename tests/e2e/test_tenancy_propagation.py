"""Tenancy changes made by another process reach the running gateway within a poll or two:
revoked keys stop, suspended tenants stop, quotas apply, deleted tenants' KV is purged."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.cli import Cli
from tests.support.gateway import KEY_SECRET, MODEL, SIGNING_KEY, Gateway

PROPAGATION_S = 2.0  # the promise
SLACK_S = 3.0  # a loaded CI machine's scheduling, on top of it


def cli(gateway: Gateway, tmp_path: Path) -> Cli:
    """The real `prefixgate` command, another process on the gateway's database."""
    runner = Cli(gateway.database_url, tmp_path)
    runner.env.update(PREFIXGATE_KEY_HASH_SECRET=KEY_SECRET,
                      PREFIXGATE_AUDIT_SIGNING_KEY=SIGNING_KEY)  # fmt: skip
    return runner


def chat(gateway: Gateway, key: str, content: str = "hello there") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def seconds_until(condition: Callable[[], bool]) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < PROPAGATION_S + SLACK_S, "the change never arrived"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_revoked_key_stops_at_once(gateway: Gateway, tmp_path: Path) -> None:
    runner = cli(gateway, tmp_path)
    created = runner.json("keys", "create", "--tenant", "globex", "--name", "short-lived")
    assert chat(gateway, created["key"]).status_code == 200  # now in the auth cache
    runner.ok("keys", "revoke", "--tenant", "globex", created["key_id"])
    seconds_until(lambda: chat(gateway, created["key"]).status_code == 401)


def test_suspension_and_quota_apply_at_once(gateway: Gateway, tmp_path: Path) -> None:
    runner = cli(gateway, tmp_path)
    tenant = runner.json("tenants", "create", "wobbly", "--quota", "64")
    key = runner.json("keys", "create", "--tenant", "wobbly")["key"]
    assert chat(gateway, key).status_code == 200
    engine = gateway.server.gateway.engine
    runner.ok("tenants", "set-quota", "wobbly", "--quota", "48")
    seconds_until(lambda: engine.cache_stats().owners[tenant["id"]].quota_blocks == 48)
    runner.ok("tenants", "suspend", "wobbly")
    seconds_until(lambda: chat(gateway, key).status_code == 403)


def test_deleting_a_tenant_purges_its_cached_blocks(gateway: Gateway, tmp_path: Path) -> None:
    runner = cli(gateway, tmp_path)
    tenant = runner.json("tenants", "create", "doomed")
    key = runner.json("keys", "create", "--tenant", "doomed")["key"]
    assert chat(gateway, key, "remember this rather long sentence " * 8).status_code == 200
    engine = gateway.server.gateway.engine

    def cached_blocks() -> int:  # as of the engine's last step
        return getattr(engine.cache_stats().owners.get(tenant["id"]), "cached_blocks", 0)

    seconds_until(lambda: cached_blocks() > 0)
    zeroed = engine.cache_stats().blocks_zeroed
    runner.ok("tenants", "delete", "doomed")
    seconds_until(lambda: cached_blocks() == 0)
    assert engine.cache_stats().blocks_zeroed > zeroed
    assert chat(gateway, key).status_code in (401, 403)
