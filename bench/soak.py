"""Soak: the shared cache under load, a noisy neighbour and a disconnect storm, then the proof
that nothing leaked (blocks, sequences, concurrency slots) and nothing was lost (audit events).

    python -m bench.soak [--seconds 60] [--clients 12] [--storm-clients 200] [--seed 0]
        [--json] [--out F] [--plot F.png]

Each scenario starts its own real gateway in this process (uvicorn on 127.0.0.1, SQLite, a
tiny random Llama with SmolLM2's tokenizer and chat template, fp32 KV, a public system prompt
registered for the model), so that once the clients are done the harness can look inside the
engine. Clients are `httpx` over HTTP with real API keys, one tenant per key.

1. load: `--clients` streaming and non-streaming clients of three tenants for `--seconds`,
   each in private multi-turn chats on the public system prompt (a turn appends the previous
   answer); some leave after the first chunk. Every status is counted; TTFT p50/p99 per
   tenant; this process's RSS at start, peak and end.
2. neighbour: tenant `steady` (quota = reservation) sends a trickle of streams alone, then
   while tenant `flood` sends long prompts from many clients, over its request rate and its
   small cache quota, into a pool that cannot hold both tenants' quotas. Reports `steady`'s
   TTFT p99 in both phases, their ratio (of the median where a phase has under 100 samples), and
   its `evicted_pressure_blocks` (must stay 0).
3. storm: `--storm-clients` clients, in waves of at most `STORM_WAVE` at once, leave mid-stream
   (after the first chunk) or mid-prefill (just after their body is sent).

After each, once the engine is idle (`idle_report`): the pool's invariants hold, no block is
active, no request or sequence is left in the engine, every free block is all zeros, every
tenant's concurrency slots are back and a fresh request of each tenant succeeds (or, for a
tenant whose flood used its whole request window, is refused saying so until that minute has
passed). For the
storm, every client has exactly one audit event, `cancelled` (or `success` if it finished
before it left). `problems` lists whatever broke; the soak holds when every list is empty.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import torch
from tqdm import tqdm

from bench.common import emit, machine, plot_bars
from bench.soak_checks import audit_check, fresh_requests, idle_report, last_audit_seq
from bench.soak_clients import (
    MAX_REQUESTS_PER_CLIENT,
    MODEL,
    SYSTEM_PROMPT,
    Drop,
    Outcome,
    RSSSampler,
    Soaked,
    chat_body,
    http_client,
    send,
    server_errors,
    soak_gateway,
    soak_model,
    status_counts,
    ttft_stats,
    words,
)
from bench.soak_neighbour import (
    NEIGHBOUR_POOL_BLOCKS,
    NEIGHBOUR_TENANTS,
    run_neighbour,
)
from tenancy.tenants import TenantLimits

# -- 1. load ---------------------------------------------------------------------------------

LOAD_TENANTS = ("load-a", "load-b", "load-c")

TURNS_PER_CHAT = 4  # then the client starts a new conversation (another `user`)
DROP_AFTER_FIRST_CHUNK = 0.15  # of the load's streams
STORM_WAVE = 50  # storm clients at once


async def load_client(
    client: httpx.AsyncClient,
    soaked: Soaked,
    tenant: str,
    index: int,
    deadline: float,
    rng: random.Random,
    record: Callable[[Outcome], None],
) -> None:
    """Private multi-turn chats on the public system prompt until `deadline`: a turn appends
    the previous answer and a new question; streams and whole answers, some left early."""
    system = {"role": "system", "content": SYSTEM_PROMPT}
    messages, chat = [system], 0
    for turn in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= deadline:
            return
        messages.append({"role": "user", "content": words(rng, rng.randint(8, 40))})
        stream = rng.random() < 0.7
        drop: Drop = "first_chunk" if stream and rng.random() < DROP_AFTER_FIRST_CHUNK else "none"
        user = f"{tenant}-{index}-{chat}"
        body = chat_body(messages, user, stream, rng.randint(4, 24))
        outcome = await send(
            client, soaked.keys[tenant], tenant, body, f"load-{tenant}-{index}-{turn}", drop
        )
        record(outcome)
        if outcome.status == 200 and not outcome.left and outcome.error is None:
            messages.append({"role": "assistant", "content": outcome.text})
        else:
            messages.pop()
        if outcome.status == 429:
            await asyncio.sleep(min(outcome.retry_after_s, 1.0))
        if len(messages) > 2 * TURNS_PER_CHAT:
            messages, chat = [system], chat + 1


LOAD_LIMITS = TenantLimits(requests_per_minute=100_000, max_concurrent=64)


async def run_load(soaked: Soaked, seconds: float, clients: int, seed: int) -> dict[str, Any]:
    """`clients` clients spread over the load tenants for `seconds`, then the idle checks."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + seconds
    with (
        RSSSampler() as rss,
        tqdm(desc="load", unit="req", file=sys.stderr, mininterval=1.0) as bar,
    ):

        def record(outcome: Outcome) -> None:
            outcomes.append(outcome)
            bar.update()

        async with http_client(clients + 4) as client:
            client.base_url = httpx.URL(soaked.server.url)
            await asyncio.gather(
                *(
                    load_client(
                        client,
                        soaked,
                        LOAD_TENANTS[i % len(LOAD_TENANTS)],
                        i,
                        deadline,
                        random.Random(rng.random()),
                        record,
                    )
                    for i in range(clients)
                )
            )
        idle = await idle_report(soaked)
    errors = server_errors(outcomes)
    per_tenant = {
        tenant: {
            "requests": len(mine := [o for o in outcomes if o.tenant == tenant]),
            "ttft": ttft_stats(mine),
            "cached_tokens": sum(o.cached_tokens for o in mine),
        }
        for tenant in LOAD_TENANTS
    }
    return {
        "seconds": seconds,
        "clients": clients,
        "requests": len(outcomes),
        "streams": sum(o.stream for o in outcomes),
        "left_after_first_chunk": sum(o.left for o in outcomes),
        "statuses": status_counts(outcomes),
        "server_errors": errors[:20],
        "tenants": per_tenant,
        "rss": rss.report(),
        "idle": idle,
        "problems": [*errors[:5], *idle["problems"]],
    }


# -- 3. disconnect storm ---------------------------------------------------------------------

STORM_LIMITS = TenantLimits(requests_per_minute=100_000, max_concurrent=STORM_WAVE + 14)


async def storm_client(
    client: httpx.AsyncClient, soaked: Soaked, index: int, rng: random.Random
) -> Outcome:
    """Half leave after their first chunk, half during prefill (a long prompt, left 0-30 ms
    after its body is sent)."""
    if index % 2:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": words(rng, 60)},
        ]
        body = chat_body(messages, f"storm-{index}", True, 64)
        return await send(
            client, soaked.keys["storm"], "storm", body, f"storm-{index}", "first_chunk"
        )
    messages = [{"role": "user", "content": words(rng, rng.randint(800, 1500))}]
    body = chat_body(messages, f"storm-{index}", rng.random() < 0.5, 64)
    return await send(
        client,
        soaked.keys["storm"],
        "storm",
        body,
        f"storm-{index}",
        "prefill",
        rng.uniform(0.0, 0.03),
    )


async def run_storm(soaked: Soaked, clients: int, seed: int) -> dict[str, Any]:
    """`clients` departing clients in waves of `STORM_WAVE`, then the idle and audit checks."""
    rng = random.Random(seed)
    first_seq = await asyncio.to_thread(last_audit_seq, soaked.state)
    outcomes: list[Outcome] = []
    with tqdm(total=clients, desc="storm", unit="client", file=sys.stderr) as bar:
        for start in range(0, clients, STORM_WAVE):
            # A client of its own each: a departure closes its connection.
            async with http_client(STORM_WAVE) as client:
                client.base_url = httpx.URL(soaked.server.url)
                wave = range(start, min(clients, start + STORM_WAVE))
                outcomes += await asyncio.gather(
                    *(storm_client(client, soaked, i, random.Random(rng.random())) for i in wave)
                )
            bar.update(len(wave))
    idle = await idle_report(soaked)
    audit = await audit_check(soaked.state, first_seq, [o.request_id for o in outcomes])
    left = [o for o in outcomes if o.left]
    errors = server_errors(outcomes)
    return {
        "clients": clients,
        "wave": STORM_WAVE,
        "left_after_first_chunk": sum(o.drop == "first_chunk" and o.left for o in outcomes),
        "left_during_prefill": sum(o.drop == "prefill" and o.left for o in outcomes),
        "answered_before_leaving": len(outcomes) - len(left),
        "statuses": status_counts(outcomes),
        "audit": audit,
        "idle": idle,
        "problems": [*errors[:5], *idle["problems"], *audit["problems"]],
    }


# -- the soak --------------------------------------------------------------------------------


Scenario = Callable[[Soaked], Coroutine[Any, Any, dict[str, Any]]]


def run_scenario(
    model_dir: Path,
    limits: dict[str, TenantLimits],
    pool_blocks: int,
    scenario: Scenario,
    **settings: Any,
) -> dict[str, Any]:
    """One scenario against a gateway of its own, after one warm-up request per tenant (the
    first request pays one-time costs that would otherwise count as a tail latency)."""
    with soak_gateway(model_dir, limits, pool_blocks, **settings) as soaked:
        started = time.perf_counter()
        asyncio.run(fresh_requests(soaked))
        result = asyncio.run(scenario(soaked))
        result["wall_s"] = round(time.perf_counter() - started, 1)
        return result


def load(model_dir: Path, seconds: float, clients: int, seed: int = 0) -> dict[str, Any]:
    limits = dict.fromkeys(LOAD_TENANTS, LOAD_LIMITS)
    return run_scenario(model_dir, limits, 2048, lambda s: run_load(s, seconds, clients, seed))


def neighbour(model_dir: Path, seconds: float, seed: int = 0) -> dict[str, Any]:
    return run_scenario(
        model_dir,
        NEIGHBOUR_TENANTS,
        NEIGHBOUR_POOL_BLOCKS,
        lambda s: run_neighbour(s, seconds, seed),
        queue_timeout_s=1,
    )


def storm(model_dir: Path, clients: int, seed: int = 0) -> dict[str, Any]:
    return run_scenario(
        model_dir,
        {"storm": STORM_LIMITS},
        2048,
        lambda s: run_storm(s, clients, seed),
        max_num_seqs=STORM_WAVE + 14,
    )


def soak(seconds: float, clients: int, storm_clients: int, seed: int) -> dict[str, Any]:
    """All three scenarios on the tiny model, written to a temporary directory."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="soak-model-") as scratch:
        model_dir = soak_model(Path(scratch))
        scenarios = {
            "load": load(model_dir, seconds, clients, seed),
            "neighbour": neighbour(model_dir, max(5.0, seconds / 4), seed),
            "storm": storm(model_dir, storm_clients, seed),
        }
    return {
        "benchmark": "soak",
        "machine": machine(),
        "model": MODEL,
        **scenarios,
        "held": not any(result["problems"] for result in scenarios.values()),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_summary(result: dict[str, Any]) -> None:
    """A few lines on stderr: what ran, the numbers that matter, and any problem."""
    load_, neighbour_, storm_ = result["load"], result["neighbour"], result["storm"]
    ttfts = ", ".join(
        f"{t} {s['ttft']['p50_ms']}/{s['ttft']['p99_ms']} ms" for t, s in load_["tenants"].items()
    )
    bounded = neighbour_["bounded_percentile"]
    lines = [
        f"load: {load_['requests']} requests from {load_['clients']} clients in "
        f"{load_['seconds']:g} s, statuses {load_['statuses']}; TTFT p50/p99 {ttfts}; "
        f"RSS {load_['rss']}",
        f"neighbour: steady TTFT {bounded} {neighbour_['steady_alone'][f'{bounded}_ms']} ms "
        f"alone, {neighbour_['steady_during_flood'][f'{bounded}_ms']} ms in the flood "
        f"(x{neighbour_['ttft_ratio']}, bound x{neighbour_['bound']:g}); flood statuses "
        f"{neighbour_['flood']['statuses']}; steady's pressure evictions "
        f"{neighbour_['steady_cache']['evicted_pressure_blocks']}",
        f"storm: {storm_['clients']} clients, audit outcomes {storm_['audit']['outcomes']}",
    ]
    for name in ("load", "neighbour", "storm"):
        lines += [f"PROBLEM ({name}): {problem}" for problem in result[name]["problems"]]
    lines.append(f"{'held' if result['held'] else 'DID NOT HOLD'}; wall time {result['wall_s']} s")
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60, help="the load's duration")
    parser.add_argument("--clients", type=int, default=12, help="the load's clients")
    parser.add_argument("--storm-clients", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw TTFT p99 per tenant and phase to this PNG")
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 3600 or not 1 <= args.clients <= 256:
        parser.error("--seconds must be 1-3600 and --clients 1-256")
    if not 1 <= args.storm_clients <= 2000:
        parser.error("--storm-clients must be 1-2000")
    torch.set_grad_enabled(False)
    result = soak(args.seconds, args.clients, args.storm_clients, args.seed)
    emit(result, args.json, args.out)
    print_summary(result)
    if args.plot:
        tenants_ = result["load"]["tenants"]
        labels = [*tenants_, "steady alone", "steady in flood"]
        values = [s["ttft"]["p99_ms"] or 0.0 for s in tenants_.values()]
        values += [
            result["neighbour"][phase]["p99_ms"] or 0.0
            for phase in ("steady_alone", "steady_during_flood")
        ]
        plot_bars(args.plot, "bench.soak TTFT p99", labels, values, "ms")
    return result


if __name__ == "__main__":
    main()
