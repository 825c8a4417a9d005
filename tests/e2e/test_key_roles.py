"""A key does one job: inference keys infer, tenant-admin keys administer."""

from __future__ import annotations

import openai
import pytest

from tests.support.gateway import Gateway


def test_tenant_admin_key_is_refused_by_the_inference_api(gateway: Gateway) -> None:
    client = openai.OpenAI(
        base_url=gateway.base_url, api_key=gateway.tenant_admin_keys["acme"], max_retries=0
    )
    after = gateway.last_audit_seq()
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "tenant-admin key" in str(refused.value)
    events = [event for event in gateway.audit_events(after) if event.action == "auth"]
    assert [(event.outcome, event.details["reason"]) for event in events] == [
        ("failure", "not_an_inference_key")
    ]
