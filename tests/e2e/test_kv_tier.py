"""The second KV tier through a real `prefixgate serve` process and the official `openai` client.

Two servers, each on PostgreSQL and a pool a little larger than one prompt: one with a disk tier
(in its state directory), one with a Redis tier. A filler prompt of another tenant that takes
every block of the pool pushes a tenant's blocks out of the pool, so its next request can only
find them in the tier. Seen from outside: the prompt comes back from the tier, and its audit
event says so; a restarted server reads its disk tier back; a deleted tenant's data key row
and tier entries are gone; a tampered tier value is a miss, not an error or other output; and
/readyz shows the tier's calibration.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, func, select

from bench.common import fp32_kv_bytes_per_token
from bench.local_server import free_port, wait_until_ready
from bench.local_workers import stop
from tenancy import admins, api_keys, tenants
from tenancy.models import WrappedDataKey
from tenancy.store import Store
from tests.support.gateway import (
    ADMIN_PASSWORD,
    ADMIN_USER,
    JWT_SECRET,
    KEY_SECRET,
    METRICS_TOKEN,
    MODEL,
    SIGNING_KEY,
)
from tests.support.postgres import create_database, database_url, drop_database
from tests.support.redis import drop_prefix, new_prefix

BLOCK_SIZE = 16
POOL_BLOCKS = 32
PROMPT_BLOCKS = 20  # full blocks of a tenant's prompt: what can come back from the tier
PROMPT_TOKENS = PROMPT_BLOCKS * BLOCK_SIZE + 5
ANSWER_TOKENS = 6
FILLER_TOKENS = POOL_BLOCKS * BLOCK_SIZE  # with max_tokens 1, every block of the pool
TENANTS = ("owner", "filler", "doomed", "tampered")
PURGE_WITHIN_S = 60.0

Result = TypeVar("Result")


def eventually(check: Callable[[], Result | None], timeout_s: float, what: str) -> Result:
    """Poll `check` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


@dataclass
class TierServer:
    """A `prefixgate serve` process with a tier, restartable on its port, state and database."""

    env: dict[str, str]
    state_dir: Path
    port: int
    keys: dict[str, str]
    tenant_ids: dict[str, str]
    database_url: str
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cli = str(Path(sys.executable).with_name("prefixgate"))
        log = self.state_dir / f"serve-{time.monotonic_ns()}.log"
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                [cli, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env, cwd=self.state_dir, stdout=output, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until_ready(self.url, self.process, log, 300.0)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=60
        )

    def complete(self, tenant: str, prompt: list[int], max_tokens: int = ANSWER_TOKENS) -> Any:
        """A greedy completion of token ids, with its response headers (`.headers`)."""
        raw = self.client(tenant).completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return raw

    def fill_pool(self) -> None:
        """The filler tenant's prompt, which takes every block of the pool: no other block
        stays cached there."""
        self.complete("filler", tokens(FILLER_TOKENS, seed=-1), max_tokens=1)

    def scrape(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=30)

    def tier_blocks(self, tenant: str) -> dict[str, float]:
        """This tenant's tier traffic on /metrics: offloaded, loaded, missed, purged, ..."""
        names = {tenant, self.tenant_ids[tenant]}
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(self.scrape("/metrics").text):
            if family.name == "prefixgate_kv_tier_blocks":
                for sample in family.samples:
                    if sample.labels.get("owner") in names:
                        counts[sample.labels["event"]] = sample.value
        return counts

    def admin(self) -> httpx.Client:
        login = httpx.post(
            f"{self.url}/admin/api/login",
            json={"username": ADMIN_USER, "password": ADMIN_PASSWORD},
            timeout=30,
        )
        assert login.status_code == 200, login.text
        token = login.json()["token"]
        return httpx.Client(
            base_url=f"{self.url}/admin/api",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )

    def audit_event(self, action: str, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The newest audit event of `action` that `match` accepts, once it has been written."""
        with self.admin() as admin:

            def find() -> dict[str, Any] | None:
                page = admin.get("/audit/events", params={"action": action, "limit": 50})
                assert page.status_code == 200, page.text
                return next((event for event in page.json()["data"] if match(event)), None)

            return eventually(find, 10.0, f"an audit event {action}")


def tokens(count: int, seed: int) -> list[int]:
    """Seeded random token ids of the tokenizer's ordinary vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(count)]


def cached_tokens(raw: Any) -> int:
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return int(usage.prompt_tokens_details.cached_tokens or 0)


def text_of(raw: Any) -> str:
    return str(raw.parse().choices[0].text)


@contextmanager
def tier_server(
    template: str, model_dir: Path, state_dir: Path, settings: dict[str, str]
) -> Iterator[TierServer]:
    """A started `TierServer` on a fresh copy of the migrated database, with an admin, the
    module's tenants and a key each, and these `PREFIXGATE_*` settings."""
    name = create_database(template=template)
    url = database_url(name)
    store = Store.open(url, state_dir / "seed.spool", KEY_SECRET, SIGNING_KEY)
    keys, tenant_ids = {}, {}
    with store.transaction() as session:
        admins.create_admin(session, ADMIN_USER, ADMIN_PASSWORD)
        for slug in TENANTS:
            tenant = tenants.create_tenant(session, slug)
            keys[slug] = api_keys.create_key(session, tenant, "e2e", KEY_SECRET).secret
            tenant_ids[slug] = str(tenant.id)
    store.close()
    block_bytes = BLOCK_SIZE * fp32_kv_bytes_per_token(model_dir)
    env = {
        **os.environ,
        "PREFIXGATE_DATABASE_URL": url,
        "PREFIXGATE_STATE_DIR": str(state_dir),
        "PREFIXGATE_KEY_HASH_SECRET": KEY_SECRET,
        "PREFIXGATE_AUDIT_SIGNING_KEY": SIGNING_KEY,
        "PREFIXGATE_JWT_SECRET": JWT_SECRET,
        "PREFIXGATE_METRICS_TOKEN": METRICS_TOKEN,
        "PREFIXGATE_MODEL_DIR": str(model_dir),
        "PREFIXGATE_DTYPE": "float32",  # a pool of exactly POOL_BLOCKS on every CPU
        "PREFIXGATE_KV_CACHE_BYTES": str(POOL_BLOCKS * block_bytes),
        "PREFIXGATE_KV_TIER_CAPACITY_BYTES": str(64 << 20),
        "PREFIXGATE_TENANCY_POLL_S": "0.2",
        **{f"PREFIXGATE_{key}": value for key, value in settings.items()},
    }
    server = TierServer(env, state_dir, free_port(), keys, tenant_ids, url)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        drop_database(name)


@pytest.fixture(scope="module")
def disk_tier(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TierServer]:
    state_dir = tmp_path_factory.mktemp("disk-tier")
    with tier_server(migrated_template, tiny_chat_dir, state_dir, {"KV_TIER": "disk"}) as server:
        yield server


@pytest.fixture(scope="module")
def redis_tier(
    migrated_template: str,
    tiny_chat_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: str,
) -> Iterator[TierServer]:
    state_dir = tmp_path_factory.mktemp("redis-tier")
    prefix = new_prefix()
    settings = {
        "KV_TIER": "redis",
        "KV_TIER_REDIS_URL": redis_server,
        "REDIS_KEY_PREFIX": prefix,
    }
    try:
        with tier_server(migrated_template, tiny_chat_dir, state_dir, settings) as server:
            yield server
    finally:
        drop_prefix(prefix)


class RedisTier:
    """The Redis tier's keys as the test reads them: each owner's sorted set of entry ids and
    byte count (engine/cache/tier/redis_store.py)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.prefix = prefix

    def base(self) -> str:
        """`<prefix>:tier:{<root>}`, from the one tier the server keeps (any of its keys: the
        calibration at start leaves its owner's tombstone, whatever else is there yet)."""
        keys: list[bytes] = list(self.client.scan_iter(match=f"{self.prefix}:tier:{{*"))
        bases = {key.decode().split("}:", 1)[0] + "}" for key in keys}
        assert len(bases) == 1, bases
        return bases.pop()

    def entries(self, tenant_id: str) -> list[str]:
        """The tenant's entry ids, lowest priority first."""
        ids = cast(list[bytes], self.client.zrange(f"{self.base()}:z:{tenant_id}", 0, -1))
        return [entry.decode() for entry in ids]

    def all_of(self, tenant_id: str, count: int) -> list[str] | None:
        """The tenant's entry ids once there are `count` of them (offloads run behind)."""
        entries = self.entries(tenant_id)
        return entries if len(entries) >= count else None

    def held_bytes(self, tenant_id: str) -> int:
        held = cast(bytes | None, self.client.hget(f"{self.base()}:bytes", tenant_id))
        return int(held or 0)

    def flip_a_byte(self, entry: str) -> None:
        """Flip one bit in the middle of an entry's sealed value, in place."""
        key = f"{self.base()}:v:{entry}"
        value = cast(bytes | None, self.client.get(key))
        assert value is not None, key
        offset = len(value) // 2
        self.client.setrange(key, offset, bytes([value[offset] ^ 0x01]))


def redis_view(server: TierServer) -> RedisTier:
    return RedisTier(
        server.env["PREFIXGATE_KV_TIER_REDIS_URL"], server.env["PREFIXGATE_REDIS_KEY_PREFIX"]
    )


def offloaded(server: TierServer, tenant: str, blocks: int) -> None:
    """Wait until the tier holds the tenant's `blocks` (offloads run in the background)."""
    eventually(
        lambda: server.tier_blocks(tenant).get("offloaded", 0) >= blocks,
        10.0,
        f"{blocks} blocks of {tenant} offloaded",
    )


# -- the disk tier ----------------------------------------------------------------------------


def test_a_prompt_pushed_out_of_the_pool_comes_back_from_the_tier_and_is_audited(
    disk_tier: TierServer,
) -> None:
    prompt = tokens(PROMPT_TOKENS, seed=1)
    cold = disk_tier.complete("owner", prompt)
    assert cached_tokens(cold) == 0
    offloaded(disk_tier, "owner", PROMPT_BLOCKS)
    disk_tier.fill_pool()

    warm = disk_tier.complete("owner", prompt)
    assert cached_tokens(warm) == PROMPT_BLOCKS * BLOCK_SIZE
    assert text_of(warm) == text_of(cold)  # the tier's KV is the KV computed (I1)

    request_id = warm.headers["x-request-id"]
    event = disk_tier.audit_event(
        "inference.completions", lambda event: event["request_id"] == request_id
    )
    details = event["details"]
    assert details["cached_tokens"] == PROMPT_BLOCKS * BLOCK_SIZE
    by_source = details["cached_by_source"]
    # Every cached token came from the tier, none from the pool the filler emptied.
    assert sum(n for source, n in by_source.items() if source.endswith(".tier")) == (
        PROMPT_BLOCKS * BLOCK_SIZE
    ), by_source
    assert by_source.get("own.tier", 0) == PROMPT_BLOCKS * BLOCK_SIZE, by_source
    assert details["tier_loads"] == PROMPT_BLOCKS
    block_bytes = BLOCK_SIZE * fp32_kv_bytes_per_token(Path(disk_tier.env["PREFIXGATE_MODEL_DIR"]))
    assert details["tier_bytes"] == PROMPT_BLOCKS * block_bytes


def test_readyz_shows_the_tiers_calibration_to_the_metrics_scraper(disk_tier: TierServer) -> None:
    ready = disk_tier.scrape("/readyz")
    assert ready.status_code == 200
    tier = ready.json()["engine"]["kv_tier"]
    assert tier["kind"] == "disk"
    assert tier["capacity_bytes"] > 0
    assert tier["latency_ms"] > 0 and tier["bytes_per_s"] > 0
    # The cost rule's two sides for one block at a prompt's start, both measured.
    assert tier["block_load_ms"] > 0 and tier["block_compute_ms"] > 0
    assert {"loaded_blocks", "recomputed_blocks"} <= tier.keys()
    anonymous = httpx.get(f"{disk_tier.url}/readyz", timeout=30).json()
    assert "engine" not in anonymous  # the description is the scraper's alone


def test_a_restarted_server_serves_a_tenants_prompt_warm_from_its_disk_tier(
    disk_tier: TierServer,
) -> None:
    prompt = tokens(PROMPT_TOKENS, seed=2)
    cold = disk_tier.complete("owner", prompt)
    offloaded(disk_tier, "owner", PROMPT_BLOCKS)
    disk_tier.stop()
    disk_tier.start()  # same state directory, port and database: a fresh pool
    warm = disk_tier.complete("owner", prompt)
    assert cached_tokens(warm) == PROMPT_BLOCKS * BLOCK_SIZE
    assert text_of(warm) == text_of(cold)
    assert disk_tier.tier_blocks("owner").get("loaded", 0) == PROMPT_BLOCKS


# -- the Redis tier ---------------------------------------------------------------------------


def test_deleting_a_tenant_shreds_its_data_key_and_empties_its_tier(redis_tier: TierServer) -> None:
    tenant_id = redis_tier.tenant_ids["doomed"]
    redis_tier.complete("doomed", tokens(PROMPT_TOKENS, seed=3))
    view = redis_view(redis_tier)
    eventually(lambda: view.all_of(tenant_id, PROMPT_BLOCKS), 10.0, "the tenant's entries")
    assert view.held_bytes(tenant_id) > 0
    subject = f"tenant:{tenant_id}"
    database = create_engine(redis_tier.database_url)

    def data_key_rows() -> int:
        with database.connect() as connection:
            query = select(func.count()).where(WrappedDataKey.subject == subject)
            return int(connection.scalar(query) or 0)

    assert data_key_rows() == 1  # made for the tenant's first request through the tier
    with redis_tier.admin() as admin:
        deleted = admin.delete(f"/tenants/{tenant_id}")
    assert deleted.status_code == 204, deleted.text
    assert data_key_rows() == 0
    database.dispose()
    event = redis_tier.audit_event("tenant.delete", lambda event: event["resource_id"] == tenant_id)
    assert event["details"]["data_key_shredded"] is True

    eventually(
        lambda: not view.entries(tenant_id) and view.held_bytes(tenant_id) == 0,
        PURGE_WITHIN_S,
        "the deleted tenant's tier entries removed",
    )


def test_a_tampered_tier_value_is_a_miss_and_the_answer_stays_the_same(
    redis_tier: TierServer,
) -> None:
    tenant_id = redis_tier.tenant_ids["tampered"]
    prompt = tokens(PROMPT_TOKENS, seed=4)
    cold = redis_tier.complete("tampered", prompt)
    view = redis_view(redis_tier)
    entries = eventually(lambda: view.all_of(tenant_id, PROMPT_BLOCKS), 10.0, "the entries")
    # The positive control: pushed out of the pool, the prompt comes back from the tier whole.
    redis_tier.fill_pool()
    assert cached_tokens(redis_tier.complete("tampered", prompt)) == PROMPT_BLOCKS * BLOCK_SIZE
    counts = redis_tier.tier_blocks("tampered")
    assert counts.get("loaded") == PROMPT_BLOCKS  # from the tier, not the pool
    misses_before = counts.get("missed", 0)

    view.flip_a_byte(entries[0])
    redis_tier.fill_pool()

    tampered = redis_tier.complete("tampered", prompt)
    assert cached_tokens(tampered) < PROMPT_BLOCKS * BLOCK_SIZE  # the block failed its tag
    assert text_of(tampered) == text_of(cold)
    assert redis_tier.tier_blocks("tampered").get("missed", 0) > misses_before
