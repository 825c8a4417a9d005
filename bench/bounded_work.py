"""Bounded work: 1 MB chat bodies are answered or refused fast, and /healthz stays quick.

    python -m bench.bounded_work [--concurrent 8] [--rounds 3] [--json] [--out F] [--plot F]

Starts the real gateway (bench.common.bench_gateway) and sends chat bodies just under the 1 MB
body limit: many small messages, and one huge message. Each is timed alone (server time as the
`Server-Timing` header reports it when answered, else client wall time on loopback), then
`--concurrent` of them are sent at once while /healthz is polled every 5 ms; its p99 is the
number that says whether one tenant's large requests slow everyone else down.
Targets: each answered or refused within 100 ms; /healthz p99 under 50 ms during the burst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.common import BENCH_MODEL, bench_gateway, emit, machine, percentile, plot_bars

TARGET_REQUEST_MS = 100.0
TARGET_HEALTHZ_P99_MS = 50.0
BODY_BYTES = 1_000_000  # just under the default 1 MiB body limit


def bodies() -> dict[str, bytes]:
    """The two shapes of a 1 MB chat request."""
    many = [{"role": "user" if i % 2 else "assistant", "content": "x" * 16} for i in range(19_000)]
    shapes = {
        "many_messages": {"messages": many},
        "huge_message": {"messages": [{"role": "user", "content": "word " * 199_900}]},
    }
    encoded = {}
    for name, fields in shapes.items():
        body = json.dumps({"model": BENCH_MODEL, "max_tokens": 1, **fields}).encode()
        assert len(body) <= BODY_BYTES, (name, len(body))
        encoded[name] = body
    return encoded


async def one(client: httpx.AsyncClient, key: str, body: bytes) -> tuple[int, float]:
    """Status and milliseconds (server time when the server reported it)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", content=body, headers=headers)
    elapsed = (time.perf_counter() - started) * 1000
    timing = response.headers.get("Server-Timing")
    if timing:
        parts = dict(part.strip().split(";dur=") for part in timing.split(","))
        elapsed = float(parts["engine"]) + float(parts["gateway"])
    return response.status_code, elapsed


async def burst(
    client: httpx.AsyncClient, key: str, body: bytes, concurrent: int
) -> dict[str, Any]:
    """`concurrent` copies of `body` at once, with /healthz polled all the while."""
    health: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=30) as probe:
            while not done.is_set():
                started = time.perf_counter()
                (await probe.get("/healthz")).raise_for_status()
                health.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.005)

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.05)
    results = await asyncio.gather(*(one(client, key, body) for _ in range(concurrent)))
    done.set()
    await poller
    return {
        "statuses": sorted({status for status, _ in results}),
        "request_ms_max": max(ms for _, ms in results),
        "healthz_p50_ms": statistics.median(health),
        "healthz_p99_ms": percentile(health, 0.99),
        "healthz_samples": len(health),
    }


async def run(server: Any, key: str, concurrent: int, rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=concurrent + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        idle: list[float] = []
        for _ in range(50):
            started = time.perf_counter()
            (await client.get("/healthz")).raise_for_status()
            idle.append((time.perf_counter() - started) * 1000)
        result["healthz_idle_p99_ms"] = percentile(idle, 0.99)
        for name, body in bodies().items():
            alone = [await one(client, key, body) for _ in range(rounds)]
            bursts = [await burst(client, key, body, concurrent) for _ in range(rounds)]
            result[name] = {
                "body_bytes": len(body),
                "statuses": sorted({status for status, _ in alone}),
                "alone_ms_median": statistics.median(ms for _, ms in alone),
                "alone_ms_max": max(ms for _, ms in alone),
                "burst_statuses": sorted({s for b in bursts for s in b["statuses"]}),
                "burst_request_ms_max": max(b["request_ms_max"] for b in bursts),
                "burst_healthz_p99_ms": max(b["healthz_p99_ms"] for b in bursts),
                "burst_healthz_p50_ms": statistics.median(b["healthz_p50_ms"] for b in bursts),
            }
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrent", type=int, default=8, help="1 MB requests at once")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw the numbers to this PNG file")
    args = parser.parse_args(argv)
    if min(args.concurrent, args.rounds) < 1:
        parser.error("--concurrent and --rounds must be >= 1")
    with bench_gateway() as (server, key):
        result: dict[str, Any] = {"benchmark": "bounded_work", "concurrent": args.concurrent}
        result.update(asyncio.run(run(server, key, args.concurrent, args.rounds)))
    shapes = ("many_messages", "huge_message")
    result["target_request_ms"] = TARGET_REQUEST_MS
    result["target_healthz_p99_ms"] = TARGET_HEALTHZ_P99_MS
    result["meets_targets"] = all(
        result[shape]["alone_ms_max"] <= TARGET_REQUEST_MS
        and result[shape]["burst_healthz_p99_ms"] <= TARGET_HEALTHZ_P99_MS
        for shape in shapes
    )
    result["machine"] = machine()
    if args.plot:
        labels = [f"{shape} {part}" for shape in shapes for part in ("alone", "healthz p99")]
        values = [
            result[shape][key]
            for shape in shapes
            for key in ("alone_ms_max", "burst_healthz_p99_ms")
        ]
        plot_bars(args.plot, "bench.bounded_work (ms)", labels, values, "ms")
    emit(result, args.json, args.out)
    if not args.json:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
