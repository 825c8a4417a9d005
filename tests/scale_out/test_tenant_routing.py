"""Two real `prefixgate worker` processes behind a real gateway: a tenant's flood queues behind
its own work, not in front of another tenant's; and what the workers report of each tenant's
service and of their steps reaches the gateway's metrics, tenants only for the scraper."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.local_workers import LocalWorker
from gateway.workers.activity import read_activity
from gateway.workers.remote_engine import RemoteEngine
from tests.scale_out.test_workers import (
    gateway_ready,
    gateway_tenant_id,
    routed,
    within,
    worker_state,
)
from tests.support.gateway import METRICS_TOKEN, MODEL, SYSTEM_PROMPT, Gateway, openai_client

# A tenant's own text after the public system prompt: globex's is long enough that its flood
# stays on the worker holding it (each of its requests there costs 64 tokens of queue), acme's
# short enough that five requests in flight there would outweigh it, one would not.
GLOBEX_TEXT = "Cargo manifest line for the globex freight account, pallet and weight. " * 30
ACME_TEXT = "Acme travel policy: economy below six hours, receipts within a week. " * 11
FLOOD = 5


@pytest.fixture(scope="module")
def cluster(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, list[LocalWorker]]]:
    """Cache-aware routing over two workers, with the default cost of load."""
    state_dir = tmp_path_factory.mktemp("tenant-routing")
    with routed(migrated_template, tiny_chat_dir, state_dir, 16 << 20) as started:
        yield started


def chat(text: str, question: str) -> list[Any]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{text}\n{question}"},
    ]


def ask(gateway: Gateway, tenant: str, messages: list[Any]) -> tuple[int, int]:
    """Prompt and cached tokens of one short answer."""
    response = openai_client(gateway, tenant).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, user="reader"
    )
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return response.usage.prompt_tokens, response.usage.prompt_tokens_details.cached_tokens or 0


def tenant_sequences(engine: RemoteEngine, tenant_id: str) -> dict[str, int]:
    """This gateway's sequences of a tenant on each worker now."""
    return dict(engine.workers.snapshot(lambda w: (w.url, w.tenant_in_flight.get(tenant_id, 0))))


def test_a_flood_queues_behind_its_own_tenant_not_in_front_of_another(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, _ = cluster
    engine = gateway.server.gateway.engine
    assert isinstance(engine, RemoteEngine)
    globex = gateway_tenant_id(gateway, "globex")
    # Both texts follow the public system prompt, whose first key puts them on one worker.
    ask(gateway, "globex", chat(GLOBEX_TEXT, "Warm-up."))
    ask(gateway, "acme", chat(ACME_TEXT, "First question?"))
    _, cached_alone = ask(gateway, "acme", chat(ACME_TEXT, "Second question?"))
    client = openai_client(gateway, "globex")
    with ExitStack() as streams:
        for index in range(FLOOD):
            chunks = streams.enter_context(
                client.chat.completions.create(
                    model=MODEL,
                    stream=True,
                    max_tokens=1200,
                    temperature=0.9,
                    user="reader",
                    logit_bias={"2": -100},  # no end of sequence: it runs its length
                    messages=chat(GLOBEX_TEXT, f"Write a very long story, number {index}."),
                )
            )
            while not next(chunks).choices[0].delta.content:  # the role comes first
                pass
        # The premise: the whole flood is on the one worker that holds globex's text.
        assert sorted(tenant_sequences(engine, globex).values()) == [0, FLOOD]
        _, cached_flooded = ask(gateway, "acme", chat(ACME_TEXT, "Third question?"))
        assert sum(tenant_sequences(engine, globex).values()) == FLOOD  # still flooding
    # Acme stays where its prompt is cached: the flood counts as one tenant at work there.
    assert cached_flooded == cached_alone > 0


def sample(text: str, series: str) -> float | None:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


def test_metrics_sum_the_workers_reports_and_name_tenants_only_to_the_scraper(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, workers = cluster
    acme = gateway_tenant_id(gateway, "acme")
    for index in range(4):
        ask(gateway, "acme", chat(ACME_TEXT, f"Metrics question {index}?"))
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}

    def steps_summed() -> bool:  # once the gateway has polled the idle workers
        shown = sample(
            httpx.get(f"{gateway.server.url}/metrics").text, "prefixgate_engine_steps_total"
        )
        return shown == sum(read_activity(worker_state(w)).steps.steps for w in workers)

    within(5, steps_summed)
    states = [worker_state(worker) for worker in workers]
    reports = [read_activity(state) for state in states]
    scraped = httpx.get(f"{gateway.server.url}/metrics", headers=scraper).text
    anonymous = httpx.get(f"{gateway.server.url}/metrics").text
    # Counters since each worker started, summed over the workers.
    assert sample(scraped, "prefixgate_engine_steps_total") == sum(r.steps.steps for r in reports)
    seconds = sample(scraped, "prefixgate_engine_step_seconds_total")
    assert seconds == pytest.approx(sum(r.steps.seconds_total for r in reports))
    prefill = 'prefixgate_engine_service_tokens_total{kind="prefill",tenant="acme"}'
    served = sum(r.service[acme].prefill_tokens for r in reports if acme in r.service)
    assert sample(scraped, prefill) == served > 0
    assert "prefixgate_engine_service_tokens_total{" not in anonymous
    for text in (scraped, anonymous):
        assert sample(text, 'prefixgate_engine_step_seconds_recent{quantile="0.99"}')
        for worker, state, report in zip(workers, states, reports, strict=True):
            target = f'prefixgate_worker_step_target_seconds{{worker="{worker.url}"}}'
            assert sample(text, target) == state["describe"]["step_cost"]["target_ms"] / 1000
            p50 = f'prefixgate_worker_step_seconds_recent{{quantile="0.5",worker="{worker.url}"}}'
            assert (sample(text, p50) is not None) == bool(report.steps.recent)
    ready = gateway_ready(gateway)["engine"]
    assert sorted(cost["target_ms"] for cost in ready["step_cost"]) == sorted(
        state["describe"]["step_cost"]["target_ms"] for state in states
    )
