"""python -m bench.replicas: one tenant's limits across two gateways that share Redis.

Two `prefixgate serve` processes on one PostgreSQL database and one Redis, routing to two engine
workers (a tiny random Llama with SmolLM2's tokenizer), all on this machine. Three tenants are
driven at once through both gateways, alternately, harder than their limits allow, for
`--seconds` (70: a whole minute and then some):

- `rpm` (120 requests a minute): small completions from 4 clients;
- `tpm` (6,000 tokens a minute): completions of 20 prompt + 10 generated tokens from 2 clients;
- `slots` (4 at once): streams of 64 tokens from 8 clients.

It reports what each tenant got against its limits: the most requests (and tokens) admitted in
any 60 seconds of the run, and the most streams open at once as the clients saw them (from the
response's headers to its last byte; a client sees its stream end a moment after the server
gave its slot back, so this can only err upwards), each as a ratio to the limit (goal: 1.00 +-
0.03). A client does not see when the limiter admitted its request, only that it was between
sending it and the answer: a request counts in a window when both lie inside it, so a
limiter that let more than its limit through in some minute shows it, while the clients' own
latency (up to a second here, with the CPUs full) cannot make a limiter that kept its limit
look as if it had not. Then the latency the shared limiter adds to a request: its two admission
steps (enter, charge) timed in this process against Redis and against the in-process store, each
`--limiter-samples` times, and the difference (goal on loopback: p50 <= 1 ms, p99 <= 5 ms);
the gateways' own histogram of their Redis steps during the run is shown beside it. Last, the
time from revoking a key through one gateway to the other refusing it (`--revocations` trials,
alternating direction; goal: p99 <= 1 s).

Needs PostgreSQL (PREFIXGATE_BENCH_POSTGRES, default postgresql+psycopg://postgres@127.0.0.1:5432/
postgres; a database is created and dropped) and Redis (--redis, default
redis://127.0.0.1:6379/0; keys under a fresh prefix, deleted after).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.common import BENCH_MODEL, emit, machine, percentile, plot_bars
from bench.served_gateway import GatewayProcess, gateway_process

SECRET = "bench-replicas-worker-secret"
KEY_SECRET, SIGNING_KEY = "bench-replicas-key-secret", "bench-replicas-signing-key"
WINDOW_S = 60.0
EOS = 2  # the tiny model's end of sequence: banned, so every answer is as long as asked
RPM, TPM, SLOTS = 120, 6000, 4
TPM_PROMPT, TPM_ANSWER = 20, 10
STREAM_TOKENS = 64


@dataclass
class Cluster:
    gateways: list[GatewayProcess]
    keys: dict[str, str]
    admin_key: str  # tenant-admin key of "acme"
    acme_id: str


@dataclass
class Record:
    """What the clients saw of one tenant."""

    # Each admitted request: (sent, answered 200, tokens it used).
    admitted: list[tuple[float, float, int]] = field(default_factory=list)
    streams: list[tuple[float, float]] = field(default_factory=list)  # (headers, last byte)
    statuses: dict[int, int] = field(default_factory=dict)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=70.0)
    parser.add_argument("--revocations", type=int, default=20)
    parser.add_argument("--limiter-samples", type=int, default=2000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args()
    say = (lambda _: None) if args.json else print
    prefix = f"prefixgate-bench-{uuid.uuid4().hex[:12]}"
    try:
        say(f"limiter steps: {args.limiter_samples} admissions against Redis and in-process")
        limiter = asyncio.run(limiter_overhead(args.redis, prefix, args.limiter_samples))
        with tempfile.TemporaryDirectory(prefix="bench-replicas-") as scratch:
            say("starting PostgreSQL database, two workers and two gateways")
            with cluster(Path(scratch), args.redis, prefix) as running:
                say(f"driving three tenants through both gateways for {args.seconds:g} s")
                records = asyncio.run(drive(running, args.seconds, progress=not args.json))
                steps = gateway_steps(running.gateways)
                say(f"revoking {args.revocations} keys")
                revocations = asyncio.run(revoke(running, args.revocations))
    finally:
        drop_redis_prefix(args.redis, prefix)
    result = report(records, args.seconds, limiter, steps, revocations)
    emit(result, args.json, args.out)
    if not args.json:
        print_table(result)
    if args.plot:
        targets = result["targets"]
        plot_bars(
            args.plot, "One tenant's limits across two gateways (observed / limit)",
            ["requests/min", "tokens/min", "concurrency"],
            [targets[name]["ratio"] for name in ("requests_per_minute", "tokens_per_minute",
                                                 "concurrency")], "ratio",
        )  # fmt: skip


# -- the cluster -------------------------------------------------------------------------------


@contextmanager
def cluster(scratch: Path, redis_url: str, prefix: str) -> Iterator[Cluster]:
    from bench.local_server import tiny_chat_model
    from bench.local_workers import session_certificates, worker_processes
    from engine.model.loader import embedded_model_dir

    model_dir = tiny_chat_model(scratch / BENCH_MODEL, embedded_model_dir())
    with ExitStack() as stack:
        url = stack.enter_context(bench_database())
        keys, admin_key, acme_id = seed(url, scratch)
        quiet = {"OMP_NUM_THREADS": "1", "PREFIXGATE_KV_CACHE_BYTES": str(64 << 20)}
        workers = stack.enter_context(
            worker_processes(2, model_dir, SECRET, scratch, environment=quiet)
        )
        settings = {
            "DATABASE_URL": url, "KEY_HASH_SECRET": KEY_SECRET, "AUDIT_SIGNING_KEY": SIGNING_KEY,
            "WORKER_SECRET": SECRET, "WORKERS": ",".join(worker.url for worker in workers),
            "REDIS_URL": redis_url, "REDIS_KEY_PREFIX": prefix,
            **session_certificates().gateway_environment(),
        }  # fmt: skip
        gateways = []
        for index in range(2):
            state = scratch / f"gateway-{index}"
            state.mkdir()
            gateways.append(stack.enter_context(
                gateway_process({**settings, "STATE_DIR": str(state)}, scratch)
            ))  # fmt: skip
        yield Cluster(gateways, keys, admin_key, acme_id)


@contextmanager
def bench_database() -> Iterator[str]:
    """A fresh PostgreSQL database at the newest schema, dropped after."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    from tenancy.migrate import upgrade

    server = make_url(os.environ.get(
        "PREFIXGATE_BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ))  # fmt: skip
    name = f"prefixgate_bench_{uuid.uuid4().hex[:12]}"

    def connect() -> psycopg.Connection[Any]:
        return psycopg.connect(
            host=server.host, port=server.port or 5432, user=server.username,
            password=server.password, dbname=server.database or "postgres", autocommit=True,
        )  # fmt: skip

    with connect() as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with connect() as connection:
            connection.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def seed(url: str, scratch: Path) -> tuple[dict[str, str], str, str]:
    from tenancy import api_keys, tenants
    from tenancy.store import Store
    from tenancy.tenants import TenantLimits

    limits = {
        "rpm": TenantLimits(requests_per_minute=RPM),
        "tpm": TenantLimits(tokens_per_minute=TPM),
        "slots": TenantLimits(max_concurrent=SLOTS),
        "acme": TenantLimits(),
    }
    store = Store.open(url, scratch / "seed.spool", KEY_SECRET, SIGNING_KEY)
    keys: dict[str, str] = {}
    with store.transaction() as session:
        for slug, tenant_limits in limits.items():
            tenant = tenants.create_tenant(session, slug, limits=tenant_limits)
            keys[slug] = api_keys.create_key(session, tenant, "bench", KEY_SECRET).secret
            if slug == "acme":
                acme_id = str(tenant.id)
                admin = api_keys.create_key(session, tenant, "a", KEY_SECRET, role="tenant-admin")
    store.close()
    return keys, admin.secret, acme_id


def drop_redis_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass
    finally:
        client.close()


# -- the load ----------------------------------------------------------------------------------


async def drive(running: Cluster, seconds: float, progress: bool = True) -> dict[str, Record]:
    records = {slug: Record() for slug in ("rpm", "tpm", "slots")}
    deadline = time.monotonic() + seconds
    ticker = asyncio.create_task(tick(deadline, seconds, progress))
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        loops = [
            *(
                completions_loop(client, running, "rpm", (4, 1), records["rpm"], deadline, i)
                for i in range(4)
            ),
            *(
                completions_loop(
                    client, running, "tpm", (TPM_PROMPT, TPM_ANSWER), records["tpm"], deadline, i
                )
                for i in range(2)
            ),
            *(streams_loop(client, running, records["slots"], deadline, i) for i in range(8)),
        ]
        await asyncio.gather(*loops)
    await ticker
    return records


async def tick(deadline: float, seconds: float, shown: bool) -> None:
    """A progress bar of the load's seconds."""
    with tqdm(total=round(seconds), unit="s", desc="load", disable=not shown) as bar:
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(1.0, left))
            bar.n = min(round(seconds), round(seconds - max(0.0, deadline - time.monotonic())))
            bar.refresh()


def completion(prompt_tokens: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": BENCH_MODEL, "prompt": list(range(100, 100 + prompt_tokens)),
            "max_tokens": max_tokens, "temperature": 0, "logit_bias": {str(EOS): -100},
            **extra}  # fmt: skip


async def completions_loop(
    client: httpx.AsyncClient,
    running: Cluster,
    slug: str,
    shape: tuple[int, int],
    record: Record,
    deadline: float,
    index: int,
) -> None:
    """Completions of `shape` (prompt tokens, answer tokens) for one tenant, through the
    gateways in turn; each admitted one is recorded with the tokens it used."""
    turn = index
    while time.monotonic() < deadline:
        gateway = running.gateways[turn % 2]
        turn += 1
        sent = time.monotonic()
        answer = await client.post(
            f"{gateway.url}/v1/completions", json=completion(*shape),
            headers={"Authorization": f"Bearer {running.keys[slug]}"},
        )  # fmt: skip
        record.count(answer.status_code)
        if answer.status_code == 200:
            usage = answer.json()["usage"]
            used = usage["prompt_tokens"] + usage["completion_tokens"]
            record.admitted.append((sent, time.monotonic(), used))
        else:
            await asyncio.sleep(0.05)


async def streams_loop(
    client: httpx.AsyncClient, running: Cluster, record: Record, deadline: float, index: int
) -> None:
    turn = index
    while time.monotonic() < deadline:
        gateway = running.gateways[turn % 2]
        turn += 1
        async with client.stream(
            "POST", f"{gateway.url}/v1/completions",
            json=completion(8, STREAM_TOKENS, stream=True),
            headers={"Authorization": f"Bearer {running.keys['slots']}"},
        ) as response:  # fmt: skip
            opened = time.monotonic()
            record.count(response.status_code)
            async for _ in response.aiter_raw():
                pass
            if response.status_code == 200:
                record.streams.append((opened, time.monotonic()))
        if response.status_code != 200:
            await asyncio.sleep(0.05)


# -- the limiter's own cost --------------------------------------------------------------------


async def limiter_overhead(redis_url: str, prefix: str, samples: int) -> dict[str, Any]:
    """Each store's enter + charge, timed in this process: Redis against this process."""
    from gateway.auth.key_auth import Caller, TenantSnapshot
    from gateway.limits.limiter import Limiter
    from gateway.limits.redis_store import RedisLimits

    snapshot = TenantSnapshot(
        sharing_mode="user", may_use_public_prefixes=True, cache_quota_blocks=64,
        cache_reservation_blocks=0, requests_per_minute=10**9, tokens_per_minute=10**9,
        max_concurrent=10**6,
    )  # fmt: skip
    caller = Caller("bench-tenant", "bench", "key", snapshot)
    timings: dict[str, list[float]] = {}
    for name, limiter in (
        ("process", Limiter()),
        ("redis", Limiter(RedisLimits(redis_url, prefix, timeout_s=1.0))),
    ):
        spent = []
        for _ in range(samples + 50):
            admission = limiter.admission(caller)
            started = time.perf_counter()
            await admission.enter()
            await admission.charge(30)
            spent.append(time.perf_counter() - started)
            admission.release(30)
            await asyncio.sleep(0)  # let the release go out
        await limiter.close()
        timings[name] = [seconds * 1000 for seconds in spent[50:]]  # past the warm-up
    stats = {name: quantiles_ms(values) for name, values in timings.items()}
    added = {key: round(stats["redis"][key] - stats["process"][key], 3) for key in stats["redis"]}
    return {"samples": samples, "per_request_ms": stats, "added_ms": added}


def quantiles_ms(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 3),
        "p99": round(percentile(values, 0.99), 3),
        "max": round(max(values), 3),
    }


def gateway_steps(gateways: list[GatewayProcess]) -> dict[str, Any]:
    """The gateways' histograms of Redis admission steps during the run: how many, and the
    bucket bounds their p50 and p99 fall under."""
    counts: dict[float, float] = {}
    for gateway in gateways:
        for line in httpx.get(f"{gateway.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("prefixgate_limits_round_trip_seconds_bucket"):
                bound = line.split('le="')[1].split('"')[0]
                upper = float("inf") if bound == "+Inf" else float(bound)
                counts[upper] = counts.get(upper, 0.0) + float(line.rsplit(" ", 1)[1])
    total = counts.get(float("inf"), 0.0)

    def under(fraction: float) -> float | None:
        for upper in sorted(counts):
            if total and counts[upper] >= fraction * total:
                return upper * 1000
        return None

    return {"steps": int(total), "p50_under_ms": under(0.5), "p99_under_ms": under(0.99)}


# -- revocation --------------------------------------------------------------------------------


async def revoke(running: Cluster, trials: int) -> list[float]:
    """Seconds from a revocation answered by one gateway to the other's first refusal."""
    waits = []
    admin = {"Authorization": f"Bearer {running.admin_key}"}
    async with httpx.AsyncClient(timeout=60) as client:
        for trial in range(trials):
            one, other = running.gateways[trial % 2], running.gateways[1 - trial % 2]
            keys_url = f"{one.url}/admin/api/tenants/{running.acme_id}/keys"
            created = await client.post(keys_url, json={"name": f"r{trial}"}, headers=admin)
            created.raise_for_status()
            key, key_id = created.json()["key"], created.json()["key_id"]
            headers = {"Authorization": f"Bearer {key}"}
            body = completion(4, 1)
            warm = await client.post(f"{other.url}/v1/completions", json=body, headers=headers)
            warm.raise_for_status()  # the other gateway has the key in its cache now
            (await client.post(f"{keys_url}/{key_id}/revoke", headers=admin)).raise_for_status()
            revoked = time.monotonic()
            while True:
                answer = await client.post(
                    f"{other.url}/v1/completions", json=body, headers=headers
                )
                if answer.status_code == 401:
                    waits.append(time.monotonic() - revoked)
                    break
                if time.monotonic() - revoked > 10:
                    waits.append(float("inf"))
                    break
                await asyncio.sleep(0.005)
    return waits


# -- the report --------------------------------------------------------------------------------


def most_in_a_window(events: Sequence[tuple[float, float, int]]) -> int:
    """The largest sum of amounts of requests sent and answered inside one `WINDOW_S`
    (whose admission, somewhere between the two, surely fell in it)."""
    best = 0
    for start, _, _ in events:
        inside = sum(
            amount for sent, answered, amount in events
            if start <= sent and answered < start + WINDOW_S
        )  # fmt: skip
        best = max(best, inside)
    return best


def most_at_once(intervals: Sequence[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = now = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


def report(
    records: dict[str, Record],
    seconds: float,
    limiter: dict[str, Any],
    steps: dict[str, Any],
    revocations: list[float],
) -> dict[str, Any]:
    requests = most_in_a_window(
        [(sent, answered, 1) for sent, answered, _ in records["rpm"].admitted]
    )
    tokens = most_in_a_window(records["tpm"].admitted)
    concurrency = most_at_once(records["slots"].streams)
    full_minute = seconds >= WINDOW_S

    def target(observed: int, limit: int) -> dict[str, Any]:
        ratio = round(observed / limit, 3)
        return {"observed": observed, "limit": limit, "ratio": ratio,
                "met": abs(ratio - 1) <= 0.03}  # fmt: skip

    added = limiter["added_ms"]
    finite = [wait for wait in revocations if wait != float("inf")]
    p99 = round(percentile(revocations, 0.99), 4) if revocations else None
    revocation = {
        "trials": len(revocations),
        "refused_after_s": {
            "p50": round(statistics.median(finite), 4) if finite else None,
            "p99": p99,
            "max": round(max(revocations), 4) if revocations else None,
        },
    }
    targets = {
        "requests_per_minute": target(requests, RPM),
        "tokens_per_minute": target(tokens, TPM),
        "concurrency": target(concurrency, SLOTS),
        "limiter_added_p50_ms": goal(added["p50"], 1.0),
        "limiter_added_p99_ms": goal(added["p99"], 5.0),
        "revocation_p99_s": goal(p99, 1.0),
    }
    return {
        "bench": "replicas",
        "machine": machine(),
        "gateways": 2,
        "workers": 2,
        "seconds": seconds,
        "whole_minute": full_minute,
        "statuses": {slug: record.statuses for slug, record in records.items()},
        "targets": targets,
        "limiter": limiter,
        "gateway_redis_steps": steps,
        "revocation": revocation,
    }


def goal(value: float | None, most: float) -> dict[str, Any]:
    """A measured value against the most it may be."""
    return {"value": value, "goal": most, "met": value is not None and value <= most}


def print_table(result: dict[str, Any]) -> None:
    targets = result["targets"]
    print(f"{'':<28}{'observed':>10}{'limit':>10}{'ratio':>8}  goal")
    for name in ("requests_per_minute", "tokens_per_minute", "concurrency"):
        row = targets[name]
        mark = "met" if row["met"] else "MISSED"
        print(f"{name:<28}{row['observed']:>10}{row['limit']:>10}{row['ratio']:>8.3f}  "
              f"1.00 +- 0.03 {mark}")  # fmt: skip
    for name, unit in (("limiter_added_p50_ms", "ms"), ("limiter_added_p99_ms", "ms"),
                       ("revocation_p99_s", "s")):  # fmt: skip
        row = targets[name]
        mark = "met" if row["met"] else "MISSED"
        print(f"{name:<28}{row['value']:>10}{'':>18}  <= {row['goal']} {unit} {mark}")
    if not result["whole_minute"]:
        print("(a run shorter than a minute cannot fill a window: the ratios are bounds)")
    print(f"statuses: {result['statuses']}")
    print(f"gateways' Redis steps: {result['gateway_redis_steps']}")


if __name__ == "__main__":
    main()
