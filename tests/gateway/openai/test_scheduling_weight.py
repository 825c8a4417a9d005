"""A real gateway: every request reaches the engine with its tenant's scheduling weight, a
weight changed through the admin API on the very next request, and the service the engine gave
the tenant comes back as its observed share."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import openai
import pytest

from engine.request import GenerationDelta, GenerationRequest
from tests.gateway.admin.test_usage import sampled_usage
from tests.support.admin import admin_client
from tests.support.gateway import MODEL, Gateway


@pytest.fixture
def engine_requests(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> list[GenerationRequest]:
    """Every request the served model's engine gets while the test runs (it still serves them)."""
    engine: Any = gateway.server.gateway.models.get(MODEL).engine
    generate = engine.generate
    seen: list[GenerationRequest] = []

    def recording(request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        seen.append(request)
        return generate(request)

    monkeypatch.setattr(engine, "generate", recording)
    return seen


def test_the_engine_gets_the_tenants_weight_and_a_changed_one_on_the_next_request(
    gateway: Gateway, engine_requests: list[GenerationRequest]
) -> None:
    with admin_client(gateway) as admin:
        created = admin.post(
            "/tenants", json={"slug": f"w-{uuid.uuid4().hex[:10]}", "scheduling_weight": 3.0}
        )
        assert created.status_code == 201, created.text
        tenant_id = created.json()["id"]
        key = admin.post(f"/tenants/{tenant_id}/keys", json={"name": "weighted"}).json()["key"]
        api = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)

        def ask() -> float:
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello " * 40}], max_tokens=3
            )
            sent = [r for r in engine_requests if r.tenant_id == tenant_id]
            return sent[-1].weight

        assert ask() == 3.0
        changed = admin.patch(f"/tenants/{tenant_id}", json={"scheduling_weight": 0.5})
        assert changed.status_code == 200, changed.text
        assert ask() == 0.5  # the key check this gateway remembered was dropped by the change
        usage = sampled_usage(admin, tenant_id, datetime.now(UTC))
    served = gateway.server.gateway.engine.service_stats()[tenant_id].service
    assert served > 0
    assert usage["scheduling_weight"] == 0.5
    assert usage["summary"]["service"] == pytest.approx(served)
    assert 0 < usage["summary"]["service_share"] <= 1
