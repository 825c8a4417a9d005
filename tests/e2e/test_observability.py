"""Health, metrics, audit events and tracing spans of the running gateway."""

from __future__ import annotations

import httpx
import openai
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.e2e.conftest import KEY_SECRET, METRICS_TOKEN, MODEL, SIGNING_KEY, Gateway


def test_health_and_readiness(gateway: Gateway) -> None:
    assert httpx.get(gateway.server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ready",
        "checks": {"engine": True, "database": True},
        "audit": {"spooled": 0, "dead_letters": 0, "dead_letter_path": None},
    }


def test_metrics_follow_requests(gateway: Gateway) -> None:
    api = openai.OpenAI(base_url=gateway.base_url, api_key=gateway.keys["acme"], max_retries=0)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "metrics"}],
                                max_tokens=3)  # fmt: skip
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    text = httpx.get(gateway.server.url + "/metrics", headers=scraper).text
    for name in (
        'prefixgate_requests_total{endpoint="chat",status="200"}',
        "prefixgate_time_to_first_token_seconds_bucket",
        'prefixgate_request_duration_seconds_count{endpoint="chat"}',
        'prefixgate_prompt_tokens_total{tenant="acme"}',
        'prefixgate_prefix_cache_hit_tokens_total{tenant="acme"}',
        'prefixgate_completion_tokens_total{tenant="acme"}',
        'prefixgate_kv_cache_blocks{owner="acme",state="quota"} 1024.0',
        "prefixgate_kv_cache_evictions_total",
        "prefixgate_kv_cache_zeroed_blocks_total",
        'prefixgate_queue_depth{state="waiting"}',
    ):
        assert name in text, name


def test_metrics_without_the_token_name_no_tenant(gateway: Gateway) -> None:
    api = openai.OpenAI(base_url=gateway.base_url, api_key=gateway.keys["acme"], max_retries=0)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "metrics"}],
                                max_tokens=2)  # fmt: skip
    anonymous = httpx.get(gateway.server.url + "/metrics")
    assert anonymous.status_code == 200
    assert 'prefixgate_requests_total{endpoint="chat",status="200"}' in anonymous.text
    assert 'owner="public"' in anonymous.text  # the public budget is nobody's identity
    for slug in gateway.keys:
        assert f'"{slug}"' not in anonymous.text
    assert "tenant=" not in anonymous.text
    wrong = httpx.get(gateway.server.url + "/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_requests_and_auth_failures_are_audited(gateway: Gateway) -> None:
    api = openai.OpenAI(base_url=gateway.base_url, api_key=gateway.keys["globex"], max_retries=0)
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


def test_spans_for_auth_policy_queue_prefill_decode(gateway: Gateway) -> None:
    exporter = InMemorySpanExporter()
    gateway.server.gateway.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    api = openai.OpenAI(base_url=gateway.base_url, api_key=gateway.keys["acme"], max_retries=0)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "trace"}],
                                max_tokens=3)  # fmt: skip
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"auth", "policy", "queue", "prefill", "decode", "inference.chat"} <= names
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    root = by_name["inference.chat"]
    for phase in ("policy", "queue", "prefill", "decode"):
        assert by_name[phase].context.trace_id == root.context.trace_id
