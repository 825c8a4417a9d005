"""GET /v1/models and /v1/models/{id} through the official `openai` client; a listing counts
as one request of its tenant's window, with the same rate-limit headers as a completion."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tenancy.tenants import TenantLimits
from tests.gateway.openai.test_response_headers import assert_rate_limit_headers
from tests.support.admin import admin_client
from tests.support.gateway import MODEL, Gateway, openai_client
from tests.support.openai_errors import assert_error


def test_models_list_names_the_one_served_model(gateway: Gateway) -> None:
    models = openai_client(gateway).models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_a_model_by_id_and_an_unknown_id_in_openais_shape(gateway: Gateway) -> None:
    api = openai_client(gateway)
    model = api.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "prefixgate")
    assert model.created == api.models.list().data[0].created
    for unknown in ("gpt-4o", "org/some-model", "x" * 5000):
        with pytest.raises(openai.NotFoundError) as raised:
            api.models.retrieve(unknown)
        error = raised.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found"
        assert error["param"] == "model" and len(error["message"]) < 400


def test_a_tenant_listing_past_its_request_limit_gets_429_with_rate_limit_headers(
    gateway: Gateway,
) -> None:
    with admin_client(gateway) as admin:
        slug = f"lister-{uuid.uuid4().hex[:8]}"
        tenant = admin.post("/tenants", json={"slug": slug, "requests_per_minute": 2})
        assert tenant.status_code == 201, tenant.text
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "list"})
        assert key.status_code == 201, key.text
    headers = {"Authorization": f"Bearer {key.json()['key']}"}
    limits = TenantLimits(requests_per_minute=2)
    for remaining in (1, 0):  # each listing takes one request of the tenant's window
        listed = httpx.get(gateway.base_url + "/models", headers=headers)
        assert listed.status_code == 200, listed.text
        assert_rate_limit_headers(listed.headers, limits)
        assert listed.headers["x-ratelimit-remaining-requests"] == str(remaining)
    for path in ("/models", f"/models/{MODEL}"):
        flooded = httpx.get(gateway.base_url + path, headers=headers)
        assert_error(flooded, 429, code="rate_limit_exceeded")
        assert_rate_limit_headers(flooded.headers, limits)
        assert flooded.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(flooded.headers["retry-after"]) >= 1
