"""A request of a tenant deleted while it was in flight ends as the deleted tenant's key does,
403 `tenant_suspended`, whether the engine is the gateway's own or a worker's; a worker answers
it 410, never 403 (a worker's 403 says that it refused the gateway's signature)."""

from __future__ import annotations

import json

from engine.errors import TenantDeleted
from gateway.errors import from_engine_error
from gateway.worker_app import status_of
from gateway.workers import wire


def test_a_deleted_tenants_request_is_a_403_from_either_engine() -> None:
    ended = TenantDeleted("the tenant was deleted; its requests are refused")
    local = from_engine_error(ended)
    assert (local.status, local.code) == (403, "tenant_suspended")

    assert status_of(ended) == 410
    crossed = wire.read_error(json.loads(json.dumps(wire.error_json(ended))))
    assert isinstance(crossed, TenantDeleted)
    remote = from_engine_error(crossed)
    assert (remote.status, remote.code) == (403, "tenant_suspended")
