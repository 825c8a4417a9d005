"""Audit events and tracing spans of the running gateway."""

from __future__ import annotations

import httpx
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.gateway import KEY_SECRET, MODEL, SIGNING_KEY, Gateway, openai_client


def test_requests_and_auth_failures_are_audited_without_the_raw_user(gateway: Gateway) -> None:
    api = openai_client(gateway, "globex")
    response = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "audit me"}], max_tokens=2, user="gil"
    )
    httpx.get(gateway.server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    gateway.server.gateway.audit.join()
    store = Store.open(gateway.database_url, gateway.server.gateway.settings.spool_path,
                       KEY_SECRET, SIGNING_KEY)  # fmt: skip
    try:
        with store.transaction() as session:
            events = list(session.scalars(select(AuditEvent).order_by(AuditEvent.seq)))
    finally:
        store.close()
    mine = [e for e in events if e.request_id == response.id]
    assert len(mine) == 1
    event = mine[0]
    assert (event.action, event.outcome) == ("inference.chat", "success")
    assert event.details["prompt_tokens"] == response.usage.prompt_tokens  # type: ignore[union-attr]
    assert event.details["completion_tokens"] == 2 and "cached_tokens" in event.details
    assert event.details["private_scope"] == "user" and event.details["model"] == MODEL
    assert "gil" not in str(event.details) and len(event.details["user_hash"]) == 32
    failures = [e for e in events if e.action == "auth" and e.outcome == "failure"]
    assert failures and failures[-1].details["reason"] == "malformed"


def test_each_phase_of_a_request_is_a_span_in_the_requests_trace(gateway: Gateway) -> None:
    exporter = InMemorySpanExporter()
    gateway.server.gateway.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    api = openai_client(gateway)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "trace"}],
                                max_tokens=3)  # fmt: skip
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"auth", "policy", "queue", "prefill", "decode", "inference.chat"} <= names
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    root = by_name["inference.chat"]
    for phase in ("policy", "queue", "prefill", "decode"):
        assert by_name[phase].context.trace_id == root.context.trace_id
