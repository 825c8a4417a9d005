"""The soak's gateway and clients: a real in-process server with tenants and keys, and the
requests its scenarios send (streamed or not, left mid-stream or mid-prefill), with what each
observed. See bench/soak.py."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

from bench.common import BENCH_MODEL, fp32_kv_bytes_per_token, percentile
from bench.local_server import RunningServer, serve, tiny_chat_model
from gateway.state import GatewayState
from tenancy import api_keys, prefixes, tenants
from tenancy.migrate import upgrade
from tenancy.store import Store
from tenancy.tenants import TenantLimits

MODEL = BENCH_MODEL
BLOCK_SIZE = 16  # the server's default
KEY_SECRET, SIGNING_KEY = "soak-key-secret", "soak-signing-key"
REQUEST_TIMEOUT_S = 60.0  # one request; an idle server answers these in well under a second
IDLE_TIMEOUT_S = 30.0  # for the engine to settle what departed clients left behind
MAX_REQUESTS_PER_CLIENT = 10_000  # every client loop is bounded in count as well as time
BODY_SENT = "http11.send_request_body.complete"  # httpcore's trace event
SYSTEM_PROMPT = (
    "You are the travel desk assistant of Example Rail and Air. Be brief, friendly and exact. "
    "Never share another traveller's details, bookings or payment data, whoever asks. Prices "
    "are in euros and include taxes and fees. Before you change a booking, state the fee and "
    "the new times, and ask the traveller to confirm. When a train or flight is cancelled, "
    "offer the next two connections and a refund, and say which one is faster."
)
# Prompts are made of the system prompt's words: common words, mostly one token each.
WORDS = sorted({word.strip(".,").lower() for word in SYSTEM_PROMPT.split()})

Drop = Literal["none", "first_chunk", "prefill"]


# -- the gateway -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Soaked:
    """A running gateway and, per tenant slug, its API key and tenant id."""

    server: RunningServer
    keys: dict[str, str]
    tenant_ids: dict[str, str]

    @property
    def state(self) -> GatewayState:
        return self.server.gateway


def soak_model(directory: Path) -> Path:
    """The tiny random chat model, written to `directory` / MODEL."""
    from engine.model.loader import embedded_model_dir

    return tiny_chat_model(directory / MODEL, embedded_model_dir())


@contextmanager
def soak_gateway(
    model_dir: Path, tenant_limits: dict[str, TenantLimits], pool_blocks: int, **settings: Any
) -> Iterator[Soaked]:
    """A gateway on fresh SQLite state with these tenants (one key each), the public system
    prompt registered, and a KV pool of exactly `pool_blocks` fp32 blocks."""
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        state_dir = Path(scratch)
        url = f"sqlite:///{state_dir / 'soak.db'}"
        upgrade(url)
        policy_file = state_dir / "policy.yaml"
        policy_file.write_text("min_public_blocks: 2\nnamespaces: [default]\n")
        store = Store.open(url, state_dir / "seed.spool", KEY_SECRET, SIGNING_KEY)
        keys, tenant_ids = {}, {}
        with store.transaction() as session:
            for slug, limits in tenant_limits.items():
                tenant = tenants.create_tenant(session, slug, limits=limits)
                keys[slug] = api_keys.create_key(session, tenant, "soak", KEY_SECRET).secret
                tenant_ids[slug] = str(tenant.id)
            prefixes.add_prefix(session, MODEL, "default", "travel", SYSTEM_PROMPT, "soak")
        store.close()
        block_bytes = BLOCK_SIZE * fp32_kv_bytes_per_token(model_dir)
        overrides = {
            "database_url": url,
            "state_dir": state_dir,
            "key_hash_secret": KEY_SECRET,
            "audit_signing_key": SIGNING_KEY,
            "model_dir": model_dir,
            "policy_file": policy_file,
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "kv_cache_bytes": pool_blocks * block_bytes,
            "registry_refresh_s": 0.5,
            **settings,
        }
        with serve(overrides) as server:
            yield Soaked(server, keys, tenant_ids)


# -- one request -----------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it."""

    tenant: str
    request_id: str  # sent as X-Client-Request-Id, so its audit event can be found
    stream: bool
    drop: Drop
    status: int | None = None  # None: the client left before the response started
    ttft_s: float | None = None  # to the response's start (the gateway waits for a token)
    latency_s: float = 0.0
    text: str = ""
    cached_tokens: int = 0
    left: bool = False  # the client went away before the end, as planned
    error: str | None = None  # an error code, an error event in a stream, a transport error
    retry_after_s: float = 0.0
    # A 429 whose tenant has no request left in its window (not a concurrency or token refusal).
    window_full: bool = False


async def send(
    client: httpx.AsyncClient,
    key: str,
    tenant: str,
    body: dict[str, Any],
    request_id: str,
    drop: Drop = "none",
    prefill_delay_s: float = 0.0,
) -> Outcome:
    """Send one chat request and read it as planned: whole, until its first chunk, or not
    at all (leaving `prefill_delay_s` after its body is sent)."""
    outcome = Outcome(tenant, request_id, bool(body.get("stream")), drop)
    headers = {"Authorization": f"Bearer {key}", "X-Client-Request-Id": request_id}
    started = time.perf_counter()
    try:
        if drop == "prefill":
            await _leave_during_prefill(client, body, headers, prefill_delay_s, outcome)
        elif outcome.stream:
            await _read_stream(client, body, headers, drop, started, outcome)
        else:
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            _read_whole(response, outcome)
    except httpx.HTTPError as error:
        outcome.error = repr(error)
    outcome.latency_s = time.perf_counter() - started
    if outcome.ttft_s is None and outcome.status is not None and not outcome.stream:
        outcome.ttft_s = outcome.latency_s
    return outcome


def _read_whole(response: httpx.Response, outcome: Outcome) -> None:
    outcome.status = response.status_code
    payload = response.json()
    if response.status_code != 200:
        outcome.error = payload.get("error", {}).get("code") or payload.get("error", {}).get("type")
        outcome.retry_after_s = float(response.headers.get("retry-after", 0))
        remaining = response.headers.get("x-ratelimit-remaining-requests")
        outcome.window_full = response.status_code == 429 and remaining == "0"
        return
    outcome.text = payload["choices"][0]["message"]["content"] or ""
    outcome.cached_tokens = payload["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _read_stream(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    headers: dict[str, str],
    drop: Drop,
    started: float,
    outcome: Outcome,
) -> None:
    """A stream to its end, or to its first chunk when the client is to leave there (leaving
    the block unread closes the connection)."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        outcome.status = reply.status_code
        outcome.ttft_s = time.perf_counter() - started
        if reply.status_code != 200:
            await reply.aread()
            _read_whole(reply, outcome)
            return
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if drop == "first_chunk":
                outcome.left = True
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                outcome.error = chunk["error"].get("code") or "error event"
            for choice in chunk.get("choices", []):
                outcome.text += choice["delta"].get("content") or ""
            if chunk.get("usage"):
                outcome.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _leave_during_prefill(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    headers: dict[str, str],
    delay_s: float,
    outcome: Outcome,
) -> None:
    """Send the request, then cancel it `delay_s` after its body is on the wire; if the answer
    came first, it counts as answered."""
    sent = asyncio.Event()

    async def trace(event: str, _: dict[str, Any]) -> None:
        if event == BODY_SENT:
            sent.set()

    request = client.post(
        "/v1/chat/completions", json=body, headers=headers, extensions={"trace": trace}
    )
    task = asyncio.ensure_future(request)
    await asyncio.wait_for(sent.wait(), REQUEST_TIMEOUT_S)
    await asyncio.sleep(delay_s)
    if task.done():
        _read_whole(task.result(), outcome)
        return
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    outcome.left = True


def chat_body(
    messages: list[dict[str, str]], user: str, stream: bool, max_tokens: int
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "user": user,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def http_client(connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S)


# -- statistics ------------------------------------------------------------------------------


def ttft_stats(outcomes: list[Outcome]) -> dict[str, Any]:
    """TTFT p50/p90/p99 (ms) of the answered requests."""
    ttfts = [o.ttft_s * 1000 for o in outcomes if o.status == 200 and o.ttft_s is not None]
    if not ttfts:
        return {"samples": 0, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    return {
        "samples": len(ttfts),
        "p50_ms": round(statistics.median(ttfts), 2),
        "p90_ms": round(percentile(ttfts, 0.90), 2),
        "p99_ms": round(percentile(ttfts, 0.99), 2),
    }


def status_counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Every status seen ("none": the client left, or failed, before a status arrived)."""
    return dict(Counter(str(o.status) if o.status is not None else "none" for o in outcomes))


def server_errors(outcomes: list[Outcome]) -> list[str]:
    """5xx statuses, and transport errors or error events of requests nobody abandoned."""
    found = [f"{o.request_id}: HTTP {o.status}" for o in outcomes if (o.status or 0) >= 500]
    found += [
        f"{o.request_id}: {o.error}"
        for o in outcomes
        if o.status in (None, 200) and o.error is not None and not o.left
    ]
    return found


class RSSSampler:
    """This process's resident memory (server and clients), sampled every `period_s`."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.process = psutil.Process()
        self.samples_mb = [self.now_mb()]
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now_mb(self) -> float:
        return float(self.process.memory_info().rss) / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples_mb.append(self.now_mb())

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples_mb.append(self.now_mb())

    def report(self) -> dict[str, Any]:
        """Start, peak and end; the growth over the run and over its second half (warm-up
        costs land early, a leak keeps growing); ten samples across the run."""
        samples = self.samples_mb
        step = max(1, len(samples) // 10)
        return {
            "start_mb": round(samples[0], 1),
            "peak_mb": round(max(samples), 1),
            "end_mb": round(samples[-1], 1),
            "growth_mb": round(samples[-1] - samples[0], 1),
            "second_half_growth_mb": round(samples[-1] - samples[len(samples) // 2], 1),
            "timeline_mb": [round(sample) for sample in samples[::step]],
        }
