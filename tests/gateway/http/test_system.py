"""The system routes: /healthz, /readyz and /metrics of the running gateway."""

from __future__ import annotations

import re

import httpx
import torch

from engine.cache.kv_spec import dtype_name
from engine.engine import Engine
from engine.precision import resolve_dtype
from tests.support.gateway import METRICS_TOKEN, MODEL, Gateway, openai_client


def test_healthz_is_ok_and_readyz_tells_anyone_only_that_it_is_ready(gateway: Gateway) -> None:
    assert httpx.get(gateway.server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready"}  # no engine, workers or limits for strangers
    # A wrong token, or a tenant's API key, is not the scraper's: the same short answer (a
    # probe must not fail over a header it carries by accident).
    for credential in ("nope", gateway.keys["acme"]):
        other = httpx.get(
            gateway.server.url + "/readyz", headers={"Authorization": f"Bearer {credential}"}
        )
        assert (other.status_code, other.json()) == (200, {"status": "ready"})


def test_readyz_reports_every_check_passing_to_the_scraper(gateway: Gateway) -> None:
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    ready = httpx.get(gateway.server.url + "/readyz", headers=scraper)
    assert ready.status_code == 200
    body = ready.json()
    engine = gateway.server.gateway.engine
    assert body == {
        "status": "ready",
        "checks": {"engine": True, "database": True},
        "engine": engine.describe(),
        "limits": {"store": "redis", "shared": True},  # the session gateway shares its limits
        "gateways": 1,
        "tenancy_changes": "notified",  # PostgreSQL tells it of every change as it commits
        "audit": {"spooled": 0, "dead_letters": 0, "dead_letter_path": None},
    }
    # What serves is reported as it is: the dtype the CPU computes natively, the C++ kernel.
    assert body["engine"]["dtype"] == dtype_name(resolve_dtype("auto"))
    assert body["engine"]["attention_backend"] == "cpu"
    assert body["engine"]["kv_blocks"] == engine.pool.num_blocks
    # The engine thread warmed up before the gateway said it was ready (engine/warm_up.py).
    assert body["engine"]["warm_up_s"] > 0


def test_metrics_for_the_scraper_count_requests_tokens_and_cache_per_tenant(
    gateway: Gateway,
) -> None:
    api = openai_client(gateway)
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
        "prefixgate_limits_shared 1.0",  # the session gateway keeps its limits in Redis
        "prefixgate_limits_fallback_steps_total 0.0",
    ):
        assert name in text, name
    # Every admission step went to Redis: two per completion (enter, charge) at least.
    steps = re.search(r"^prefixgate_limits_round_trip_seconds_count (\S+)$", text, re.MULTILINE)
    assert steps and float(steps.group(1)) >= 2
    engine = gateway.server.gateway.engine
    assert isinstance(engine, Engine)
    if engine.threads is None:  # one CPU thread: nothing governed, nothing shown
        assert torch.get_num_threads() < 2
        assert "prefixgate_engine_cpu_threads" not in text
    else:  # a CPU engine whose threads spin (tests/conftest.py): the count it computes with
        shown = re.search(r"^prefixgate_engine_cpu_threads (\S+)$", text, re.MULTILINE)
        assert shown and 1 <= float(shown.group(1)) <= engine.threads.all_threads
        assert re.search(r"^prefixgate_engine_cpu_narrowings_total \d", text, re.MULTILINE)


def test_metrics_without_the_token_name_no_tenant(gateway: Gateway) -> None:
    api = openai_client(gateway)
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


def sample(text: str, series: str) -> float | None:
    """The value of one series (its name and labels as exposed) in a scrape, or None."""
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


def test_metrics_show_each_tenants_service_to_the_scraper_and_step_times_to_all(
    gateway: Gateway,
) -> None:
    api = openai_client(gateway)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "service"}],
                                max_tokens=3)  # fmt: skip
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    scraped = httpx.get(gateway.server.url + "/metrics", headers=scraper).text
    for series in (
        'prefixgate_engine_service_tokens_total{kind="prefill",tenant="acme"}',
        'prefixgate_engine_service_tokens_total{kind="decode",tenant="acme"}',
        'prefixgate_engine_service_weighted_tokens_total{tenant="acme"}',
    ):
        assert (sample(scraped, series) or 0) > 0, series
    anonymous = httpx.get(gateway.server.url + "/metrics").text
    assert "prefixgate_engine_service_tokens_total{" not in anonymous
    assert "prefixgate_engine_service_weighted_tokens_total{" not in anonymous
    # Step times name no tenant: every scraper sees them.
    engine = gateway.server.gateway.engine
    target_ms = engine.describe()["step_cost"]["target_ms"]
    for text in (scraped, anonymous):
        assert (sample(text, "prefixgate_engine_steps_total") or 0) > 0
        assert (sample(text, "prefixgate_engine_step_seconds_total") or 0) > 0
        p50 = sample(text, 'prefixgate_engine_step_seconds_recent{quantile="0.5"}')
        p99 = sample(text, 'prefixgate_engine_step_seconds_recent{quantile="0.99"}')
        assert p50 is not None and p99 is not None and 0 < p50 <= p99
        assert sample(text, "prefixgate_engine_step_target_seconds") == target_ms / 1000
