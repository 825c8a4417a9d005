"""Gateway benchmark: latency the HTTP path adds over calling the engine, and many streams.

    python -m bench.gateway [--requests 200] [--streams 200] [--json] [--out F] [--plot F]

Starts the real gateway (uvicorn on a localhost port, SQLite, a tiny random Llama with the
SmolLM2 tokenizer) in this process. Overhead: the same chat request, alternately through
HTTP with the official `openai`-compatible wire format and straight into `Engine.generate`;
p50/p99 of the difference. Streams: N concurrent streaming clients, counting every error.
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
from engine.cache.scope import User
from engine.request import GenerationRequest
from engine.sampling.sampler import SamplingParams
from policies.templates import render_with_spans

TARGET_OVERHEAD_P50_MS = 2.0
MODEL = BENCH_MODEL
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Lisbon in May."}]


async def overhead(server: Any, key: str, requests: int, max_tokens: int) -> dict[str, float]:
    state = server.gateway
    tokenizer = state.models.get(MODEL).loaded.tokenizer
    token_ids, _ = render_with_spans(tokenizer, MESSAGES)  # as the gateway does
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    http, direct, server_side = [], [], []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        headers = {"Authorization": f"Bearer {key}"}
        for index in range(requests + 5):
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            response.raise_for_status()
            http_s = time.perf_counter() - started
            timing = dict(
                part.strip().split(";dur=") for part in response.headers["Server-Timing"].split(",")
            )
            request = GenerationRequest(
                f"direct-{index}", "bench-direct", token_ids,
                SamplingParams(max_tokens=max_tokens, temperature=0.0),
                tail_scope=User("bench-direct", "u"),
            )  # fmt: skip
            started = time.perf_counter()
            async for _ in state.engine.generate(request):
                pass
            direct_s = time.perf_counter() - started
            if index >= 5:  # the first few warm caches and code paths
                http.append(http_s * 1000)
                direct.append(direct_s * 1000)
                server_side.append(float(timing["gateway"]))
    differences = [h - d for h, d in zip(http, direct, strict=True)]
    return {
        # What the gateway adds inside the server: arrival to response minus engine time.
        "server_overhead_p50_ms": statistics.median(server_side),
        "server_overhead_p99_ms": percentile(server_side, 0.99),
        "http_p50_ms": statistics.median(http),
        "direct_p50_ms": statistics.median(direct),
        "overhead_p50_ms": statistics.median(differences),
        "overhead_p99_ms": percentile(differences, 0.99),
        "http_p99_ms": percentile(http, 0.99),
        "direct_p99_ms": percentile(direct, 0.99),
    }


async def streams(server: Any, key: str, count: int, max_tokens: int) -> dict[str, Any]:
    errors: list[str] = []
    ttfts: list[float] = []
    tokens = 0
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens
        headers = {"Authorization": f"Bearer {key}", "X-PrefixGate-User": f"user-{index}"}
        started = time.perf_counter()
        first = None
        done = False
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers=headers) as response:  # fmt: skip
                if response.status_code != 200:
                    errors.append(f"status {response.status_code}")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"])
                        return
                    if first is None and chunk["choices"]:
                        first = time.perf_counter() - started
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as error:
            errors.append(repr(error))
            return
        if not done:
            errors.append("stream ended without [DONE]")
        if first is not None:
            ttfts.append(first)

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
        await asyncio.gather(*(one(client, index) for index in range(count)))
    seconds = time.perf_counter() - started
    return {
        "concurrent_streams": count,
        "stream_errors": len(errors),
        "stream_error_examples": errors[:3],
        "streams_seconds": seconds,
        "streamed_tokens_per_s": tokens / seconds,
        "stream_ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else None,
        "stream_ttft_p99_ms": percentile(ttfts, 0.99) * 1000 if ttfts else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="overhead samples")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw latencies to this PNG file")
    args = parser.parse_args(argv)
    if min(args.requests, args.streams, args.max_tokens) < 1:
        parser.error("--requests, --streams and --max-tokens must be >= 1")

    overrides = {"max_num_seqs": 256, "kv_cache_bytes": 256 << 20}
    with bench_gateway(overrides) as (server, key):
        result: dict[str, Any] = {"benchmark": "gateway", "model": MODEL,
                                  "max_tokens": args.max_tokens}  # fmt: skip
        result.update(asyncio.run(overhead(server, key, args.requests, args.max_tokens)))
        result.update(asyncio.run(streams(server, key, args.streams, args.max_tokens)))
    result["target_overhead_p50_ms"] = TARGET_OVERHEAD_P50_MS
    result["meets_overhead_target"] = result["server_overhead_p50_ms"] <= TARGET_OVERHEAD_P50_MS
    result["machine"] = machine()
    if args.plot:
        plot_bars(args.plot, "bench.gateway latency (ms)",
                  ["HTTP p50", "direct p50", "overhead p50", "overhead p99"],
                  [result["http_p50_ms"], result["direct_p50_ms"], result["overhead_p50_ms"],
                   result["overhead_p99_ms"]], "ms")  # fmt: skip
    emit(result, args.json, args.out)
    if not args.json:
        for name, value in result.items():
            if name != "machine":
                print(f"{name:<28} {value:.3f}" if isinstance(value, float) else
                      f"{name:<28} {value}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
