"""One administrator's changes per minute are limited, and another's are not slowed by it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client
from tests.support.gateway import Gateway, start_gateway

CHANGES_PER_MINUTE = 4


@pytest.fixture(scope="module")
def limited_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with start_gateway(
        migrated_template,
        tiny_chat_dir,
        tmp_path_factory.mktemp("change-limit-state"),
        [("acme", "user", TenantLimits())],
        admin_changes_per_minute=CHANGES_PER_MINUTE,
    ) as started:
        yield started


def test_one_tenant_admin_cannot_make_changes_faster_than_its_limit(
    limited_gateway: Gateway,
) -> None:
    gateway = limited_gateway
    with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as client:
        tenant_id = client.get("/me").json()["tenant_id"]
        answers = [
            client.post(f"/tenants/{tenant_id}/keys", json={"name": f"k{n}"})
            for n in range(CHANGES_PER_MINUTE + 1)
        ]
    assert [a.status_code for a in answers] == [201] * CHANGES_PER_MINUTE + [429]
    assert int(answers[-1].headers["Retry-After"]) >= 1
    assert answers[-1].json()["error"]["type"] == "rate_limit_error"
    last = gateway.audit_events()[-1]
    assert (last.action, last.outcome) == ("api_key.create", "failure")
    with admin_client(gateway) as root:  # another administrator is not slowed by it
        created = root.post(f"/tenants/{tenant_id}/keys", json={"name": "root's"})
        assert created.status_code == 201
