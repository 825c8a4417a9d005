"""The server's own memory under steady load: does its RSS level off?

    python -m bench.server_rss [--seconds 300] [--clients 12] [--json] [--out F]

`bench.soak` measures RSS in the process that runs both the gateway and its clients. Here the
gateway is a `prefixgate serve` subprocess of its own (the tiny chat model, fp32, SQLite) and
only its RSS is sampled, every 5 s, while `--clients` clients hold multi-turn chats on the
soak's system prompt (70% streamed, some left mid-stream). Memory a server touches once (KV
pages, allocator arenas, caches of bounded size) shows as early growth; a leak keeps growing.
The run holds when the last third grows by at most `LATE_GROWTH_LIMIT` of the peak.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import emit, machine
from bench.local_server import tiny_chat_model
from bench.served_gateway import served_gateway
from bench.soak_clients import SYSTEM_PROMPT, WORDS
from engine.model.loader import embedded_model_dir

MODEL = "tiny-chat"
SAMPLE_S = 5.0
LATE_GROWTH_LIMIT = 0.05  # of the peak, over the run's last third
LEAVE_STREAM = 0.02  # chance to leave a stream at each line
TURNS = 4  # then a new conversation (another user)


async def chat_client(url: str, key: str, seed: int, deadline: float) -> int:
    """Multi-turn chats until `deadline`; returns how many requests it sent."""
    rng, sent = random.Random(seed), 0
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        messages: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            if len(messages) >= 2 * TURNS or not messages:
                messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            messages.append({"role": "user", "content": question})
            body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 1.0,
                    "user": f"user-{seed}-{sent // TURNS}"}  # fmt: skip
            if rng.random() < 0.7:
                async with client.stream(
                    "POST", "/v1/chat/completions", json={**body, "stream": True}
                ) as response:
                    async for _ in response.aiter_lines():
                        if rng.random() < LEAVE_STREAM:
                            break
            else:
                await client.post("/v1/chat/completions", json=body)
            messages.append({"role": "assistant", "content": "Noted."})
            sent += 1
    return sent


async def measure(
    url: str, key: str, server: psutil.Process, seconds: float, clients: int
) -> tuple[list[float], int]:
    """The server's RSS in MB every SAMPLE_S while `clients` chat; and the requests sent."""
    deadline = time.monotonic() + seconds
    samples: list[float] = []

    async def sample() -> None:
        while time.monotonic() < deadline:
            samples.append(server.memory_info().rss / 2**20)
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    sent = await asyncio.gather(*(chat_client(url, key, seed, deadline) for seed in range(clients)))
    await sampler
    return samples, sum(sent)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="server-rss-") as scratch:
        model = tiny_chat_model(Path(scratch) / MODEL, embedded_model_dir())
        with served_gateway(model, 256 << 20, "float32", 4096, 64, "rss") as served:
            url, key = served.url, served.keys["rss"][0]
            (server,) = [
                child
                for child in psutil.Process().children(recursive=True)
                if "serve" in " ".join(child.cmdline())
            ]
            samples, requests = asyncio.run(measure(url, key, server, args.seconds, args.clients))
    peak, late = max(samples), samples[len(samples) * 2 // 3 :]
    late_growth = late[-1] - late[0] if late else 0.0
    result = {
        "benchmark": "server_rss",
        "machine": machine(),
        "seconds": args.seconds,
        "clients": args.clients,
        "requests": requests,
        "start_mb": round(samples[0]),
        "peak_mb": round(peak),
        "end_mb": round(samples[-1]),
        "last_third_growth_mb": round(late_growth, 1),
        "timeline_mb": [round(sample) for sample in samples],
        "levelled_off": late_growth <= LATE_GROWTH_LIMIT * peak,
    }
    emit(result, args.json, args.out)
    if not args.json:
        print(
            f"{requests} requests; server RSS {result['start_mb']} -> {result['peak_mb']} MB, "
            f"last third {late_growth:+.1f} MB: levelled off {result['levelled_off']}"
        )
    return result


if __name__ == "__main__":
    main()
