"""bench.fairness' tenants: each tenant's traffic in a process of its own, so that no client
competes with the server, or with another tenant's clients, for the GIL of the process that
measures (as clients on other machines would not). See bench/fairness.py.

A flood is `concurrency` clients sending long prompts back to back, every other one with echo
and prompt logprobs; a trickle is one short request every `interval_s`, sent on time whether or
not the one before has been answered (open loop: a slow answer does not slow the rate). Prompts
are fresh random token ids from the tokenizer's normal vocabulary, so no request finds another's
prefix in the cache. Every request goes to `/v1/completions` without streaming; its latency is
from sending to the whole answer, and its tokens are the `usage` the server reports.

Traffic runs for its `seconds` or until its parent says stop, whichever comes first. Then a
flood leaves what it has in flight (the server cancels those when their connections close), and
a trickle waits for its answers, so that every short request it sent is timed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 600.0  # a long prompt behind a flood of others, at most
TRICKLE_CONNECTIONS = 64
TRAFFIC_MAX_S = 1200.0  # a bound on a traffic process, whatever its parent says


@dataclass(frozen=True, slots=True)
class Traffic:
    """One tenant's requests: a flood when `concurrency` > 0, else a trickle every `interval_s`."""

    tenant: str
    key: str
    prompt_tokens: int
    max_tokens: int
    concurrency: int = 0
    interval_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Answer:
    """One answered request as its client saw it; times are `time.monotonic()`, one clock for
    every process of this machine. A refusal or a failure has status != 200 and no tokens."""

    tenant: str
    sent_at: float
    done_at: float
    status: int
    prompt_tokens: int
    completion_tokens: int
    echo: bool
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.done_at - self.sent_at

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def completion_body(
    model: str, prompt: list[int], max_tokens: int, echo: bool, user: str
) -> dict[str, Any]:
    """A greedy `/v1/completions` body; with `echo`, the prompt's logprobs come back too."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "user": user,
    }
    if echo:
        body |= {"echo": True, "logprobs": 1}
    return body


async def send(client: httpx.AsyncClient, traffic: Traffic, body: dict[str, Any]) -> Answer:
    """One request and what came back (a failure to connect or read is status 0)."""
    sent, echo = time.monotonic(), bool(body.get("echo"))
    headers = {"Authorization": f"Bearer {traffic.key}"}
    try:
        response = await client.post("/v1/completions", json=body, headers=headers)
    except httpx.HTTPError as error:
        return Answer(traffic.tenant, sent, time.monotonic(), 0, 0, 0, echo, type(error).__name__)
    done = time.monotonic()
    if response.status_code != 200:
        code = str(response.json().get("error", {}).get("code")) if response.content else None
        return Answer(traffic.tenant, sent, done, response.status_code, 0, 0, echo, code)
    usage = response.json()["usage"]
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return Answer(traffic.tenant, sent, done, 200, prompt, completion, echo)


async def flood_client(
    client: httpx.AsyncClient,
    traffic: Traffic,
    model: str,
    vocabulary: Sequence[int],
    index: int,
    rng: random.Random,
) -> list[Answer]:
    """Long prompts back to back until cancelled; the request in flight then is left."""
    answers: list[Answer] = []
    try:
        for turn in itertools.count():
            prompt = rng.choices(vocabulary, k=traffic.prompt_tokens)
            echo = (index + turn) % 2 == 1
            body = completion_body(model, prompt, traffic.max_tokens, echo, f"flood-{index}")
            answers.append(await send(client, traffic, body))
            if answers[-1].status != 200:
                await asyncio.sleep(0.1)  # a refusal: do not spin on it
    except asyncio.CancelledError:
        pass
    return answers


async def flood(
    client: httpx.AsyncClient,
    traffic: Traffic,
    model: str,
    vocabulary: Sequence[int],
    rng: random.Random,
    until: asyncio.Future[Any],
) -> list[Answer]:
    """`traffic.concurrency` flood clients until `until` is done."""
    clients = [
        asyncio.ensure_future(
            flood_client(client, traffic, model, vocabulary, i, random.Random(rng.random()))
        )
        for i in range(traffic.concurrency)
    ]
    await until
    for task in clients:
        task.cancel()
    return [answer for answers in await asyncio.gather(*clients) for answer in answers]


async def trickle(
    client: httpx.AsyncClient,
    traffic: Traffic,
    model: str,
    vocabulary: Sequence[int],
    rng: random.Random,
    until: asyncio.Future[Any],
) -> list[Answer]:
    """A short request every `traffic.interval_s` until `until` is done, then their answers."""
    sent: list[asyncio.Future[Answer]] = []
    started = time.monotonic()
    while not until.done():
        prompt = rng.choices(vocabulary, k=traffic.prompt_tokens)
        body = completion_body(model, prompt, traffic.max_tokens, False, "trickle")
        sent.append(asyncio.ensure_future(send(client, traffic, body)))
        next_at = started + len(sent) * traffic.interval_s
        await asyncio.wait([until], timeout=max(0.0, next_at - time.monotonic()))
    return list(await asyncio.gather(*sent))


async def run_traffic(
    url: str,
    model: str,
    traffic: Traffic,
    vocabulary: Sequence[int],
    seed: int,
    seconds: float,
    stopped: asyncio.Event,
) -> list[Answer]:
    """One tenant's traffic for `seconds` or until `stopped` is set."""

    async def until() -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), min(seconds, TRAFFIC_MAX_S))

    # A trickle's requests must never wait for a connection: that wait would count as latency.
    connections = traffic.concurrency + 4 if traffic.concurrency else TRICKLE_CONNECTIONS
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        load = flood if traffic.concurrency else trickle
        rng = random.Random(seed)
        return await load(client, traffic, model, vocabulary, rng, asyncio.ensure_future(until()))


def main() -> None:
    """The process's side: a JSON spec on stdin's first line, "started" on stdout once its
    clients run, traffic until "stop" (or the end of stdin, or its seconds), then its answers
    as one JSON line."""
    spec = json.loads(sys.stdin.readline())

    async def run() -> list[Answer]:
        loop, stopped = asyncio.get_running_loop(), asyncio.Event()

        def wait_for_stop() -> None:
            sys.stdin.readline()
            loop.call_soon_threadsafe(stopped.set)

        threading.Thread(target=wait_for_stop, daemon=True).start()
        traffic = Traffic(**spec["traffic"])
        running = asyncio.ensure_future(
            run_traffic(
                spec["url"], spec["model"], traffic, spec["vocabulary"], spec["seed"],
                spec["seconds"], stopped,
            )
        )  # fmt: skip
        print("started", flush=True)
        return await running

    print(json.dumps([asdict(answer) for answer in asyncio.run(run())]), flush=True)


class TrafficProcess:
    """A tenant's traffic in a process of its own (`python -m bench.fairness_load`, which
    imports little): `start`, then `stop` (or let its `seconds` run out), then `answers`."""

    def __init__(
        self,
        url: str,
        model: str,
        traffic: Traffic,
        vocabulary: Sequence[int],
        seed: int,
        seconds: float = TRAFFIC_MAX_S,
    ) -> None:
        self._spec = {
            "url": url, "model": model, "traffic": asdict(traffic),
            "vocabulary": list(vocabulary), "seed": seed, "seconds": seconds,
        }  # fmt: skip
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        """Start the process; returns once its clients run."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.fairness_load"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(self._spec) + "\n")
        self._process.stdin.flush()
        if self._process.stdout.readline().strip() != "started":
            raise RuntimeError(f"a traffic process did not start (exit {self._process.wait()})")

    def stop(self) -> None:
        """Tell its clients to stop (a trickle still waits for its answers)."""
        assert self._process is not None and self._process.stdin is not None
        with suppress(BrokenPipeError):
            self._process.stdin.write("stop\n")
            self._process.stdin.flush()

    def answers(self) -> list[Answer]:
        """What its clients saw (waits for the traffic to end)."""
        assert self._process is not None and self._process.stdout is not None
        line = self._process.stdout.readline()
        if self._process.wait(60) != 0 or not line:
            raise RuntimeError(f"a traffic process failed (exit {self._process.returncode})")
        assert self._process.stdin is not None
        self._process.stdin.close()
        return [Answer(**row) for row in json.loads(line)]


if __name__ == "__main__":
    main()
