"""bench.fairness' scenarios: who floods and who trickles in each, run on every scheduling
mode's server in turn, scenario by scenario. See bench/fairness.py.

The servers all run for the whole bench; each scenario runs on one, then on the next (the
order rotated by one mode per scenario), so that the modes' windows of one scenario are
seconds apart, not minutes: the machines this runs on change speed by up to 2x within
minutes, and that drift would otherwise land in the comparison.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

import httpx
from tqdm import tqdm

from bench.fairness_load import Answer, Traffic, TrafficProcess, completion_body, send
from bench.fairness_server import FairnessServer
from bench.fairness_service import (
    Sample,
    Series,
    ServiceSampler,
    metrics_series,
    usage_series,
)

HEAVY, LIGHT, SECOND = "heavy-a", "light-b", "heavy-c"
HEAVY_MAX_TOKENS = 16
LIGHT_PROMPT_TOKENS, LIGHT_MAX_TOKENS = 32, 2
HEAVIER_WEIGHT = 2.0
# Scenario -> (the tenants that flood, whether light-b trickles); `weighted` runs with
# heavy-a's weight set to HEAVIER_WEIGHT first.
SCENARIOS: dict[str, tuple[tuple[str, ...], bool]] = {
    "light_alone": ((), True),
    "heavy_alone": ((HEAVY,), False),
    "mixed": ((HEAVY,), True),
    "equal": ((HEAVY, SECOND), False),
    "weighted": ((HEAVY, SECOND), False),
}


@dataclass(frozen=True, slots=True)
class Sizes:
    """The run's shape: each window's length, the floods' ramp, and the tenants' traffic."""

    seconds: float = 30.0
    ramp_s: float = 5.0
    concurrency: int = 4
    prompt_tokens: int = 1900
    light_interval_s: float = 0.5


@dataclass(frozen=True, slots=True)
class Window:
    """One scenario's measured window (`time.monotonic()`) and every answer its tenants got."""

    start: float
    end: float
    answers: list[Answer]

    def of(self, tenant: str) -> list[Answer]:
        return [answer for answer in self.answers if answer.tenant == tenant]


@dataclass(frozen=True, slots=True)
class Measured:
    """One mode's run: its windows by scenario, each tenant's weighted service and tokens
    computed over time and their source ("metrics" or "usage"), the sampler's scrapes, and why
    `weighted` did not run."""

    server: FairnessServer
    windows: dict[str, Window]
    series: Series
    tokens: Series
    source: str
    samples: list[Sample]
    weight_error: str | None


@dataclass(frozen=True, slots=True)
class Bench:
    """One mode's server and what its scenarios share: the model's name, the prompts'
    vocabulary, the run's shape and the sampler of its /metrics."""

    server: FairnessServer
    model: str
    vocabulary: list[int]
    sizes: Sizes
    seed: int
    sampler: ServiceSampler

    def flood(self, tenant: str) -> Traffic:
        s, key = self.sizes, self.server.keys[tenant]
        return Traffic(tenant, key, s.prompt_tokens, HEAVY_MAX_TOKENS, concurrency=s.concurrency)

    def trickle(self) -> Traffic:
        key, interval = self.server.keys[LIGHT], self.sizes.light_interval_s
        return Traffic(LIGHT, key, LIGHT_PROMPT_TOKENS, LIGHT_MAX_TOKENS, interval_s=interval)

    def process(self, traffic: Traffic, **seconds: float) -> TrafficProcess:
        """Its traffic's process; the same seed for a tenant on every mode (the same prompts)."""
        seed = self.seed + (HEAVY, LIGHT, SECOND).index(traffic.tenant)
        return TrafficProcess(
            self.server.url, self.model, traffic, self.vocabulary, seed, **seconds
        )


async def run_window(bench: Bench, floods: Sequence[str], light: bool) -> Window:
    """The floods' tenants flood (from `ramp_s` before the window), light-b trickles through
    the window if `light`; then the floods stop and the engine drops what they left."""
    flooding = [bench.process(bench.flood(tenant)) for tenant in floods]
    for process in flooding:
        await asyncio.to_thread(process.start)
    if flooding:
        await asyncio.sleep(bench.sizes.ramp_s)
    answers: list[Answer] = []
    if light:
        trickling = bench.process(bench.trickle(), seconds=bench.sizes.seconds)
        await asyncio.to_thread(trickling.start)
        start = time.monotonic()
        answers += await asyncio.to_thread(trickling.answers)
    else:
        start = time.monotonic()
        await asyncio.sleep(bench.sizes.seconds)
    end = time.monotonic()
    for process in flooding:
        process.stop()
    for process in flooding:
        answers += await asyncio.to_thread(process.answers)
    await bench.sampler.wait_idle()
    return Window(start, end, answers)


async def warm_up(bench: Bench) -> None:
    """One request of each tenant, one after another: the first requests pay one-time costs
    (allocators, code paths, a tenant's first key lookup) that would otherwise land in a
    measured window. One long prompt warms what long prompts need; heavy-c's is short."""
    rng = random.Random(bench.seed)
    second = replace(bench.flood(SECOND), prompt_tokens=LIGHT_PROMPT_TOKENS)
    async with httpx.AsyncClient(base_url=bench.server.url, timeout=600) as client:
        for traffic in (bench.trickle(), second, bench.flood(HEAVY)):
            prompt = rng.choices(bench.vocabulary, k=traffic.prompt_tokens)
            body = completion_body(bench.model, prompt, traffic.max_tokens, False, "warm-up")
            answer = await send(client, traffic, body)
            if answer.status != 200:
                raise RuntimeError(f"warm-up of {traffic.tenant}: HTTP {answer.status}")


async def measure(
    servers: Mapping[str, FairnessServer],
    models: Mapping[str, str],
    vocabulary: list[int],
    sizes: Sizes,
    seed: int,
    progress: tqdm[Any],
) -> dict[str, Measured]:
    """Every scenario on every mode's server, scenario by scenario."""
    async with AsyncExitStack() as stack:
        benches = {}
        for mode, server in servers.items():
            sampler = ServiceSampler(server.url, server.metrics_token)
            await stack.enter_async_context(sampler)
            benches[mode] = Bench(server, models[mode], vocabulary, sizes, seed, sampler)
            await warm_up(benches[mode])
        windows: dict[str, dict[str, Window]] = {mode: {} for mode in benches}
        weight_errors: dict[str, str | None] = dict.fromkeys(benches)
        modes = list(benches)
        for index, (name, (floods, light)) in enumerate(SCENARIOS.items()):
            for mode in modes[index % len(modes) :] + modes[: index % len(modes)]:
                progress.set_postfix_str(f"{name} on {mode}")
                bench = benches[mode]
                if name == "weighted":
                    weight_errors[mode] = await asyncio.to_thread(
                        bench.server.set_weight, HEAVY, HEAVIER_WEIGHT
                    )
                if weight_errors[mode] is None:
                    windows[mode][name] = await run_window(bench, floods, light)
                progress.update()
    return {
        mode: measured(bench, windows[mode], weight_errors[mode]) for mode, bench in benches.items()
    }


def measured(bench: Bench, windows: dict[str, Window], weight_error: str | None) -> Measured:
    """A mode's windows with its service series: from /metrics where the server reports
    service per tenant, else from the answers' usage."""
    samples = bench.sampler.samples
    tenant_ids = bench.server.tenant_ids
    if bench.sampler.has_service:
        # A tenant's label is its slug once it has sent a request, its id before.
        slugs = {slug: slug for slug in tenant_ids} | {
            id_: slug for slug, id_ in tenant_ids.items()
        }
        series, tokens = metrics_series(samples, slugs), metrics_series(samples, slugs, True)
        source = "metrics"
    else:
        answers = [answer for window in windows.values() for answer in window.answers]
        series = tokens = usage_series(answers, [sample.at for sample in samples])
        source = "usage"
    return Measured(bench.server, windows, series, tokens, source, samples, weight_error)
