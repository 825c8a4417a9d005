"""One real gateway (uvicorn on a localhost port) over PostgreSQL, for tests/gateway and tests/e2e.

The session fixture `gateway` (in tests/conftest.py, so that both folders share one) starts it
with `start_gateway`; tests that need other settings start their own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from sqlalchemy import func, select

from bench.local_server import RunningServer, serve
from engine.cache.stats import OwnerStats
from tenancy import admins, api_keys, prefixes, tenants
from tenancy.migrate import upgrade
from tenancy.models import AuditEvent
from tenancy.store import Store
from tenancy.tenants import TenantLimits
from tests.support.postgres import create_database, database_url, drop_database

MODEL = "tiny-chat"
SYSTEM_PROMPT = (
    "You are the booking assistant of Example Airlines. Be brief and friendly. Never share "
    "another passenger's details. Prices are in euros and include taxes. For changes, "
    "explain the fee before confirming anything."
)
KEY_SECRET = "e2e-key-secret"
METRICS_TOKEN = "e2e-metrics-token"
SIGNING_KEY = "e2e-signing-key"
JWT_SECRET = "e2e-jwt-secret-with-at-least-32-bytes!"
ADMIN_USER = "root"
ADMIN_PASSWORD = "correct horse battery staple"


@dataclass
class Gateway:
    """A running gateway, one API key per tenant (by slug), and its database."""

    server: RunningServer
    keys: dict[str, str]
    database_url: str
    # One tenant-admin key per tenant (by slug): it administers that tenant and no other.
    tenant_admin_keys: dict[str, str]

    @property
    def admin_url(self) -> str:
        return f"{self.server.url}/admin/api"

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"

    def audit_events(self, after_seq: int = 0) -> list[AuditEvent]:
        """Audit events written so far (after `after_seq`), once the writer has caught up."""
        self.server.gateway.audit.join()
        store = self.server.gateway.store
        with store.transaction() as session:
            query = select(AuditEvent).where(AuditEvent.seq > after_seq).order_by(AuditEvent.seq)
            return list(session.scalars(query))

    def wait_for_audit_events(
        self, after_seq: int, count: int, timeout_s: float = 10.0
    ) -> list[AuditEvent]:
        """`audit_events`, polled until `count` have arrived: a request the connection layer
        answers itself (a 408, say) is settled just after its response leaves, so its event
        can still be on its way when the client has read the response."""
        deadline = time.monotonic() + timeout_s
        events = self.audit_events(after_seq)
        while len(events) < count and time.monotonic() < deadline:
            time.sleep(0.05)
            events = self.audit_events(after_seq)
        return events

    def settled_stats(self, tenant_id: str) -> OwnerStats:
        """The tenant's engine stats once its finished requests hold no block: the engine
        records them at the end of a step, which may come just after the answer's last byte."""
        deadline = time.monotonic() + 10
        while True:
            stats = self.server.gateway.engine.cache_stats().owners[tenant_id]
            if stats.active_blocks == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def last_audit_seq(self) -> int:
        self.server.gateway.audit.join()
        with self.server.gateway.store.transaction() as session:
            return session.scalar(select(func.max(AuditEvent.seq))) or 0


def openai_client(gateway: Gateway, tenant: str = "acme") -> openai.OpenAI:
    """The unmodified official `openai` client, with `tenant`'s key and no retries."""
    return openai.OpenAI(base_url=gateway.base_url, api_key=gateway.keys[tenant], max_retries=0)


# The session gateway's tenants: each limit below is what some test needs to reach.
SESSION_TENANTS = [
    ("acme", "user", TenantLimits()),
    ("globex", "user", TenantLimits()),
    ("initech", "tenant", TenantLimits()),
    ("frozen", "user", TenantLimits()),
    ("tight", "user", TenantLimits(requests_per_minute=3, max_concurrent=1)),
    ("thrifty", "user", TenantLimits(tokens_per_minute=300)),
    ("solo", "user", TenantLimits(max_concurrent=1)),
    ("cramped", "user", TenantLimits(cache_quota_blocks=4)),
]


@contextmanager
def start_gateway(
    template: str,
    model_dir: Path,
    state_dir: Path,
    tenant_rows: list[tuple[str, str, TenantLimits]],
    **settings: Any,
) -> Iterator[Gateway]:
    """A gateway on a fresh copy of the migrated database, with these tenants and one key each
    (tenant "frozen" suspended), the airline prompt registered, and these settings."""
    name = create_database(template=template)
    url = database_url(name)
    policy_file = state_dir / "policy.yaml"
    policy_file.write_text(
        "min_public_blocks: 2\nallow_tenant_sharing: true\nnamespaces: [default]\n"
    )
    store = Store.open(url, state_dir / "seed.spool", KEY_SECRET, SIGNING_KEY)
    keys, admin_keys = {}, {}
    with store.transaction() as session:
        admins.create_admin(session, ADMIN_USER, ADMIN_PASSWORD)
        for slug, sharing, limits in tenant_rows:
            tenant = tenants.create_tenant(session, slug, sharing_mode=sharing, limits=limits)
            keys[slug] = api_keys.create_key(session, tenant, "e2e", KEY_SECRET).secret
            admin_keys[slug] = api_keys.create_key(
                session, tenant, "e2e-admin", KEY_SECRET, role="tenant-admin"
            ).secret
            if slug == "frozen":
                tenants.set_status(session, "frozen", "suspended")
        prefixes.add_prefix(session, MODEL, "default", "airline", SYSTEM_PROMPT, "e2e")
    store.close()
    overrides = {
        "database_url": url,
        "state_dir": state_dir,
        "key_hash_secret": KEY_SECRET,
        "audit_signing_key": SIGNING_KEY,
        "jwt_secret": JWT_SECRET,
        "model_dir": model_dir,
        "policy_file": policy_file,
        "kv_cache_bytes": 64 << 20,
        "max_body_bytes": 64 * 1024,
        "max_prompt_tokens": 1500,
        "max_messages": 256,
        "registry_refresh_s": 0.5,
        "queue_timeout_s": 5,
        "metrics_token": METRICS_TOKEN,
        # Every test logs in from 127.0.0.1; tests of the throttle set their own limit.
        "admin_login_attempts_per_minute": 10_000,
        "admin_changes_per_minute": 10_000,
        **settings,
    }
    try:
        with serve(overrides) as server:
            yield Gateway(server, keys, url, admin_keys)
    finally:
        drop_database(name)


@contextmanager
def sqlite_gateway(
    state_dir: Path, loaded: Any = None, **settings: Any
) -> Iterator[tuple[RunningServer, str]]:
    """A gateway on a fresh SQLite database in `state_dir`, one tenant and its API key:
    (server, key). `loaded` serves that model (else `settings` name one)."""
    url = f"sqlite:///{state_dir / 'prefixgate.db'}"
    upgrade(url)
    store = Store.open(url, state_dir / "seed.spool", KEY_SECRET, SIGNING_KEY)
    with store.transaction() as session:
        tenant = tenants.create_tenant(session, "t")
        key = api_keys.create_key(session, tenant, "k", KEY_SECRET).secret
    store.close()
    overrides = {
        "database_url": url, "state_dir": state_dir, "key_hash_secret": KEY_SECRET,
        "audit_signing_key": SIGNING_KEY, "kv_cache_bytes": 64 << 20, **settings,
    }  # fmt: skip
    with serve(overrides, loaded=loaded) as server:
        yield server, key
