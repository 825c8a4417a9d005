"""The real Redis server the tests share (PREFIXGATE_TEST_REDIS), each test under its own key
prefix."""

from __future__ import annotations

import os
import uuid

import redis

SERVER_URL = os.environ.get("PREFIXGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def check_server() -> None:
    """Fail with what to do when no Redis answers."""
    try:
        redis.Redis.from_url(SERVER_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as error:
        raise RuntimeError(
            f"no Redis server at {SERVER_URL} ({error}); .ci/run starts one, or set "
            "PREFIXGATE_TEST_REDIS"
        ) from error


def new_prefix() -> str:
    return f"prefixgate-test-{uuid.uuid4().hex[:12]}"


def drop_prefix(prefix: str) -> None:
    """Delete every key under `prefix` (a test's leftovers)."""
    client = redis.Redis.from_url(SERVER_URL)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
