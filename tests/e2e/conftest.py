"""One real gateway (uvicorn on a localhost port) over PostgreSQL for the e2e tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.local_server import RunningServer, serve, tiny_chat_model
from tenancy import api_keys, prefixes, tenants
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
SIGNING_KEY = "e2e-signing-key"


@dataclass
class Gateway:
    server: RunningServer
    keys: dict[str, str]
    database_url: str

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)


@pytest.fixture(scope="session")
def gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    name = create_database(template=migrated_template)
    url = database_url(name)
    state_dir = tmp_path_factory.mktemp("gateway-state")
    policy_file = state_dir / "policy.yaml"
    policy_file.write_text(
        "min_public_blocks: 2\nallow_tenant_sharing: true\nnamespaces: [default]\n"
    )
    store = Store.open(url, state_dir / "seed.spool", KEY_SECRET, SIGNING_KEY)
    keys = {}
    with store.transaction() as session:
        for slug, sharing, limits in [
            ("acme", "user", TenantLimits()),
            ("globex", "user", TenantLimits()),
            ("initech", "tenant", TenantLimits()),
            ("frozen", "user", TenantLimits()),
            ("tight", "user", TenantLimits(requests_per_minute=3, max_concurrent=1)),
            ("thrifty", "user", TenantLimits(tokens_per_minute=300)),
            ("solo", "user", TenantLimits(max_concurrent=1)),
        ]:
            tenant = tenants.create_tenant(session, slug, sharing_mode=sharing, limits=limits)
            keys[slug] = api_keys.create_key(session, tenant, "e2e", KEY_SECRET).secret
        tenants.set_status(session, "frozen", "suspended")
        prefixes.add_prefix(session, MODEL, "default", "airline", SYSTEM_PROMPT, "e2e")
    store.close()
    overrides = {
        "database_url": url,
        "state_dir": state_dir,
        "key_hash_secret": KEY_SECRET,
        "audit_signing_key": SIGNING_KEY,
        "model_dir": tiny_chat_dir,
        "policy_file": policy_file,
        "kv_cache_bytes": 64 << 20,
        "max_body_bytes": 64 * 1024,
        "max_prompt_tokens": 1500,
        "registry_refresh_s": 0.5,
        "queue_timeout_s": 5,
    }
    with serve(overrides) as server:
        yield Gateway(server, keys, url)
    drop_database(name)
