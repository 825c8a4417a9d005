"""Two real `prefixgate serve` processes on one PostgreSQL database and one Redis, routing to
engine workers of two models (the embedded SmolLM2, and a small random Qwen2 written here):
a tenant's limits hold once across both gateways, a change made through one reaches the other
in well under a second, a gateway killed mid-stream gives its slots back within the lease,
Redis going away fails open without a 5xx, each model is served through either gateway by its
own workers only, and a worker that missed a purge and a quota change while away gets them
from a gateway that never saw them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import pytest

from bench.local_server import tiny_chat_model
from bench.local_workers import LocalWorker, gateway_link, session_certificates, worker_process
from bench.served_gateway import GatewayProcess, gateway_process
from gateway.workers.membership import WorkerSet
from gateway.workers.remote_engine import RemoteEngine
from gateway.workers.routing import RoutingConfig
from gateway.workers.wire import read_stats
from tenancy import api_keys, tenants
from tenancy.store import Store
from tenancy.tenants import TenantLimits
from tests.support.cli import Cli
from tests.support.postgres import create_database, database_url, drop_database
from tests.support.redis import drop_prefix, new_prefix
from tests.support.tcp_proxy import TcpProxy

T = TypeVar("T")
SECRET = "replicas-test-worker-secret"
KEY_SECRET, SIGNING_KEY = "replicas-key-secret", "replicas-signing-key"
JWT_SECRET = "replicas-jwt-secret-with-at-least-32-bytes!"
METRICS_TOKEN = "replicas-metrics-token"  # /readyz's details are the scraper's
SMOL, QWEN = "smollm2-135m-instruct", "tiny-qwen2"
LEASE_S = 3.0
EOS = 2  # both models' end-of-sequence id: a bias of -100 keeps a stream going
TENANTS = {
    "acme": TenantLimits(),
    "rpm": TenantLimits(requests_per_minute=30),
    "slots": TenantLimits(max_concurrent=2),
    "slots-kill": TenantLimits(max_concurrent=2),
    "tpm": TenantLimits(tokens_per_minute=400),
    "doomed": TenantLimits(),
    "shrinking": TenantLimits(cache_quota_blocks=64),
}


@dataclass
class Replicas:
    """Two gateways, the workers of two models, and the knobs the tests turn."""

    gateways: list[GatewayProcess]
    keys: dict[str, str]  # inference key by tenant slug
    admin_keys: dict[str, str]  # tenant-admin key by tenant slug
    tenant_ids: dict[str, str]
    workers: dict[str, LocalWorker]  # by model
    model_dirs: dict[str, Path]
    redis: TcpProxy  # every gateway reaches Redis through it
    qwen_link: TcpProxy  # every gateway reaches the Qwen2 worker through it
    settings: dict[str, str]
    scratch: Path
    stack: ExitStack = field(default_factory=ExitStack)

    def start_gateways(self, count: int) -> list[GatewayProcess]:
        """More gateways, as the others are, started side by side (stopped with the module)."""
        starting = []
        for index in range(len(self.gateways), len(self.gateways) + count):
            state_dir = self.scratch / f"gateway-{index}"
            state_dir.mkdir()
            settings = {**self.settings, "STATE_DIR": str(state_dir)}
            starting.append(gateway_process(settings, self.scratch))
        started = enter_together(self.stack, starting)
        self.gateways += started
        return started

    def start_gateway(self) -> GatewayProcess:
        """One more gateway."""
        (started,) = self.start_gateways(1)
        return started


@pytest.fixture(scope="module")
def replicas(
    migrated_template: str,
    smollm2_dir: Path,
    redis_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Replicas]:
    scratch = tmp_path_factory.mktemp("replicas")
    qwen_dir = tiny_chat_model(scratch / QWEN, smollm2_dir, architecture="qwen2")
    name = create_database(template=migrated_template)
    url = database_url(name)
    keys, admin_keys, tenant_ids = seed(url, scratch)
    prefix = new_prefix()
    redis_host = urlsplit(redis_server)
    redis = TcpProxy(redis_host.hostname or "127.0.0.1", redis_host.port or 6379).start()
    quiet = {"OMP_NUM_THREADS": "1", "PREFIXGATE_DTYPE": "float32"}
    with ExitStack() as stack:
        stack.callback(drop_database, name)
        stack.callback(drop_prefix, prefix)
        stack.callback(redis.stop)
        smol, qwen = enter_together(stack, [
            worker_process(smollm2_dir, SECRET, scratch,
                           {**quiet, "PREFIXGATE_KV_CACHE_BYTES": str(96 << 20)}),
            worker_process(qwen_dir, SECRET, scratch,
                           {**quiet, "PREFIXGATE_KV_CACHE_BYTES": str(16 << 20)}),
        ])  # fmt: skip
        qwen_port = urlsplit(qwen.url).port or 0
        qwen_link = TcpProxy("127.0.0.1", qwen_port).start()
        stack.callback(qwen_link.stop)
        settings = {
            "DATABASE_URL": url, "KEY_HASH_SECRET": KEY_SECRET, "AUDIT_SIGNING_KEY": SIGNING_KEY,
            "JWT_SECRET": JWT_SECRET, "WORKER_SECRET": SECRET, "METRICS_TOKEN": METRICS_TOKEN,
            "WORKERS": f"{smol.url},https://127.0.0.1:{qwen_link.port}",
            **session_certificates().gateway_environment(),
            "WORKER_POLL_S": "0.25", "WORKER_TIMEOUT_S": "2",
            "REDIS_URL": f"redis://127.0.0.1:{redis.port}/0", "REDIS_KEY_PREFIX": prefix,
            "LIMIT_LEASE_S": str(LEASE_S), "REGISTRY_REFRESH_S": "0.5",
        }  # fmt: skip
        cluster = Replicas(
            [], keys, admin_keys, tenant_ids, {SMOL: smol, QWEN: qwen},
            {SMOL: smollm2_dir, QWEN: qwen_dir}, redis, qwen_link, settings, scratch, stack,
        )  # fmt: skip
        cluster.start_gateways(2)
        # A gateway is ready once one worker answers; the tests start from both known to each.
        for gateway in cluster.gateways:
            seconds_until(lambda g=gateway: ready(g)["engine"]["workers_up"] == 2, 30)
        yield cluster


def enter_together(stack: ExitStack, managers: list[AbstractContextManager[T]]) -> list[T]:
    """Enter context managers side by side (processes that each take seconds to be ready);
    each one entered is exited with `stack`, also when another failed to start."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
        concurrent.futures.wait(futures)
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager)
    return [future.result() for future in futures]


def seed(url: str, scratch: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The tenants, an inference key and a tenant-admin key each."""
    store = Store.open(url, scratch / "seed.spool", KEY_SECRET, SIGNING_KEY)
    keys, admin_keys, tenant_ids = {}, {}, {}
    with store.transaction() as session:
        for slug, limits in TENANTS.items():
            tenant = tenants.create_tenant(session, slug, limits=limits)
            tenant_ids[slug] = str(tenant.id)
            keys[slug] = api_keys.create_key(session, tenant, "k", KEY_SECRET).secret
            admin_keys[slug] = api_keys.create_key(
                session, tenant, "admin", KEY_SECRET, role="tenant-admin"
            ).secret
    store.close()
    return keys, admin_keys, tenant_ids


def complete(
    gateway: GatewayProcess, key: str, model: str = QWEN, prompt_tokens: int = 8,
    max_tokens: int = 1, **extra: Any,
) -> httpx.Response:  # fmt: skip
    """A completion from token ids (no tokenizer involved)."""
    body = {"model": model, "prompt": list(range(100, 100 + prompt_tokens)),
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
    return httpx.post(
        f"{gateway.url}/v1/completions", json=body,
        headers={"Authorization": f"Bearer {key}"}, timeout=120,
    )  # fmt: skip


@contextlib.contextmanager
def held_streams(gateways: list[GatewayProcess], key: str) -> Iterator[None]:
    """One long stream through each gateway, open (its first chunk read) while inside."""
    opened = threading.Barrier(len(gateways) + 1, timeout=60)
    leave = threading.Event()
    failures: list[str] = []

    def hold(gateway: GatewayProcess) -> None:
        body = {"model": QWEN, "prompt": list(range(100, 110)), "max_tokens": 2000,
                "stream": True, "temperature": 0, "logit_bias": {str(EOS): -100}}  # fmt: skip
        try:
            with httpx.stream(
                "POST", f"{gateway.url}/v1/completions", json=body, timeout=60,
                headers={"Authorization": f"Bearer {key}"},
            ) as response:  # fmt: skip
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.read()!r}")
                lines = response.iter_lines()  # kept: a dropped iterator closes the response
                next(lines)
                opened.wait()
                leave.wait(60)
        except (httpx.HTTPError, threading.BrokenBarrierError) as error:
            failures.append(repr(error))

    threads = [threading.Thread(target=hold, args=(g,), daemon=True) for g in gateways]
    for thread in threads:
        thread.start()
    try:
        opened.wait()
        assert not failures, failures
        yield
    finally:
        leave.set()
        for thread in threads:
            thread.join(30)


def worker_state(worker: LocalWorker) -> dict[str, Any]:
    answer = worker.request(
        "GET", "/internal/v1/state", headers={"Authorization": f"Bearer {SECRET}"}
    )
    answer.raise_for_status()
    state: dict[str, Any] = answer.json()
    return state


def prompt_tokens_seen(worker: LocalWorker) -> int:
    """Prompt tokens the worker's engine has been asked for (its tenants' counters)."""
    return read_stats(worker_state(worker)["stats"]).prompt_tokens


def seconds_until(condition: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "it never happened"
        time.sleep(0.02)
    return time.monotonic() - started


def ready(gateway: GatewayProcess) -> dict[str, Any]:
    """The gateway's /readyz as the metrics scraper sees it (anyone else gets the status)."""
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    body: dict[str, Any] = httpx.get(f"{gateway.url}/readyz", headers=scraper, timeout=10).json()
    assert "engine" in body, body  # the token was taken: the details are there
    return body


def test_both_gateways_list_both_models_and_share_their_limits(replicas: Replicas) -> None:
    for gateway in replicas.gateways:
        listed = httpx.get(
            f"{gateway.url}/v1/models",
            headers={"Authorization": f"Bearer {replicas.keys['acme']}"}, timeout=10,
        ).json()  # fmt: skip
        assert sorted(model["id"] for model in listed["data"]) == [SMOL, QWEN]
        body = ready(gateway)
        assert body["limits"] == {"store": "redis", "shared": True}
        assert body["tenancy_changes"] == "notified"
        assert body["engine"]["models"] == [SMOL, QWEN]
        assert body["engine"]["workers_up"] == 2
        # Each gateway reports itself every few seconds, and counts the others.
        seconds_until(lambda gateway=gateway: ready(gateway)["gateways"] == 2, 12)


def test_each_model_answers_through_either_gateway_on_its_own_workers(
    replicas: Replicas,
) -> None:
    for model in (SMOL, QWEN):
        other = QWEN if model == SMOL else SMOL
        before = {name: prompt_tokens_seen(w) for name, w in replicas.workers.items()}
        for gateway in replicas.gateways:
            answer = complete(gateway, replicas.keys["acme"], model, prompt_tokens=12)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
        after = {name: prompt_tokens_seen(w) for name, w in replicas.workers.items()}
        assert after[model] - before[model] == 2 * 12
        assert after[other] == before[other]  # the other model's worker saw nothing of it
    chat = httpx.post(
        f"{replicas.gateways[1].url}/v1/chat/completions",
        json={"model": SMOL, "messages": [{"role": "user", "content": "What is the capital of "
              "France?"}], "max_tokens": 12, "temperature": 0},
        headers={"Authorization": f"Bearer {replicas.keys['acme']}"}, timeout=120,
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert "Paris" in chat.json()["choices"][0]["message"]["content"]
    unknown = complete(replicas.gateways[0], replicas.keys["acme"], "no-such-model")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_requests_per_minute_are_counted_once_across_gateways(replicas: Replicas) -> None:
    statuses = [
        complete(replicas.gateways[index % 2], replicas.keys["rpm"]).status_code
        for index in range(40)
    ]
    assert statuses.count(200) == 30, statuses  # not 60: one window for both gateways
    assert set(statuses) == {200, 429}
    refused = complete(replicas.gateways[1], replicas.keys["rpm"])
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_concurrency_is_counted_once_across_gateways(replicas: Replicas) -> None:
    key = replicas.keys["slots"]
    with held_streams(replicas.gateways, key):  # two slots, one through each gateway
        for gateway in replicas.gateways:
            third = complete(gateway, key)
            assert third.status_code == 429, third.text
            assert "concurrent" in third.json()["error"]["message"]
    seconds_until(lambda: complete(replicas.gateways[0], key).status_code == 200, 10)


def test_tokens_per_minute_are_counted_once_across_gateways(replicas: Replicas) -> None:
    used, statuses = 0, []
    for index in range(40):
        answer = complete(
            replicas.gateways[index % 2], replicas.keys["tpm"], prompt_tokens=20, max_tokens=10,
            logit_bias={str(EOS): -100},
        )  # fmt: skip
        statuses.append(answer.status_code)
        if answer.status_code != 200:
            assert "token rate limit" in answer.json()["error"]["message"], answer.text
            break
        usage = answer.json()["usage"]
        used += usage["prompt_tokens"] + usage["completion_tokens"]
    cost = 30  # 20 prompt tokens and all 10 completion tokens
    assert used <= 400 < used + cost, (used, statuses)  # 13 requests' worth, not 26


def test_a_key_revoked_through_one_gateway_fails_on_the_other_within_a_second(
    replicas: Replicas,
) -> None:
    one, other = replicas.gateways[:2]
    admin = {"Authorization": f"Bearer {replicas.admin_keys['acme']}"}
    keys_url = f"{one.url}/admin/api/tenants/{replicas.tenant_ids['acme']}/keys"
    waits = []
    for trial in range(3):
        created = httpx.post(keys_url, json={"name": f"short-{trial}"}, headers=admin, timeout=30)
        assert created.status_code == 201, created.text
        key, key_id = created.json()["key"], created.json()["key_id"]
        assert complete(other, key).status_code == 200  # in the other gateway's key cache
        revoked = httpx.post(f"{keys_url}/{key_id}/revoke", headers=admin, timeout=30)
        assert revoked.status_code == 200, revoked.text
        waits.append(seconds_until(lambda key=key: complete(other, key).status_code == 401, 5))
    assert max(waits) < 1.0, waits


def test_a_gateway_killed_mid_stream_gives_its_slots_back_within_the_lease(
    replicas: Replicas,
) -> None:
    doomed = replicas.start_gateway()
    key, survivor = replicas.keys["slots-kill"], replicas.gateways[0]
    with held_streams([doomed, doomed], key):
        assert complete(survivor, key).status_code == 429  # both slots held, in Redis
        doomed.kill()
        killed = time.monotonic()
    back = seconds_until(lambda: complete(survivor, key).status_code == 200, 2 * LEASE_S + 5)
    assert time.monotonic() - killed <= LEASE_S + 1.5, back  # the lease, and a poll's slack


def test_redis_away_fails_open_with_no_5xx_and_comes_back(replicas: Replicas) -> None:
    gateways = replicas.gateways[:2]
    replicas.redis.stop()
    try:
        statuses = [
            complete(gateways[index % 2], replicas.keys["acme"]).status_code for index in range(10)
        ]
        assert statuses == [200] * 10  # limited in each gateway's process meanwhile
        for gateway in gateways:
            body = ready(gateway)
            assert body["status"] == "ready" and body["limits"]["store"] == "process"
            assert "fail-open" in body["limits"]["note"]
    finally:
        replicas.redis.start()
    for gateway in gateways:
        seconds_until(lambda gateway=gateway: ready(gateway)["limits"]["store"] == "redis", 10)
    assert complete(gateways[0], replicas.keys["acme"]).status_code == 200
    metrics = httpx.get(f"{gateways[0].url}/metrics", timeout=10).text
    fallbacks = next(
        line for line in metrics.splitlines()
        if line.startswith("prefixgate_limits_fallback_steps_total ")
    )  # fmt: skip
    assert float(fallbacks.split()[1]) >= 5


def test_a_rolling_update_switches_once_and_an_alias_is_a_model_of_its_own(
    replicas: Replicas, smollm2_dir: Path
) -> None:
    """New weights under the model's name (a rolling update) and the old weights under a
    second name (an alias), seen by a gateway's worker set of its own."""
    scratch = replicas.scratch
    newer = tiny_chat_model(scratch / "newer" / QWEN, smollm2_dir, hidden_size=96,
                            architecture="qwen2")  # fmt: skip
    quiet = {"OMP_NUM_THREADS": "1", "PREFIXGATE_KV_CACHE_BYTES": str(8 << 20)}
    with ExitStack() as stack:
        updated, alias = enter_together(stack, [
            worker_process(newer, SECRET, scratch, quiet),
            worker_process(replicas.model_dirs[QWEN], SECRET, scratch,
                           {**quiet, "PREFIXGATE_SERVED_MODEL_NAME": "alias-qwen"}),
        ])  # fmt: skip
        late = TcpProxy("127.0.0.1", urlsplit(updated.url).port or 0)  # the update, held back
        stack.callback(late.stop)
        workers = WorkerSet(
            [replicas.workers[QWEN].url, f"https://127.0.0.1:{late.port}", alias.url],
            gateway_link(SECRET), poll_s=0.25, timeout_s=2.0,
        )  # fmt: skip
        stack.callback(workers.stop)
        engine = RemoteEngine(workers, RoutingConfig("cache_aware", 64, 8))
        workers.poll_once()
        old = engine.models()
        assert sorted(old) == ["alias-qwen", QWEN]
        assert old["alias-qwen"].fingerprint == old[QWEN].fingerprint  # one model's weights
        late.start()  # the new weights come up: one worker each
        workers.poll_once()
        assert workers.workers[f"https://127.0.0.1:{late.port}"].up
        assert engine.models()[QWEN].fingerprint == old[QWEN].fingerprint  # met first: kept
        workers.mark_down(workers.workers[replicas.workers[QWEN].url], "drained for the update")
        new = engine.models()
        assert new[QWEN].fingerprint != old[QWEN].fingerprint  # now only the new one serves
        assert new[QWEN].loaded.tokenizer is not None and new[QWEN].max_model_len == 2048
        assert new["alias-qwen"].fingerprint == old[QWEN].fingerprint


def test_a_worker_that_missed_a_purge_and_a_quota_gets_them_from_a_new_gateway(
    replicas: Replicas,
) -> None:
    """The gateways that made the changes are gone when the worker comes back: what it
    missed is the database's, not a gateway's memory. (Last: it kills the module's gateways.)"""
    qwen, ids = replicas.workers[QWEN], replicas.tenant_ids
    for slug in ("doomed", "shrinking"):
        answer = complete(replicas.gateways[0], replicas.keys[slug], prompt_tokens=40)
        assert answer.status_code == 200, answer.text
    owners = worker_state(qwen)["stats"]["owners"]
    assert owners[ids["doomed"]]["cached_blocks"] > 0
    replicas.qwen_link.stop()  # the worker is cut off from every gateway
    for gateway in replicas.gateways[:2]:
        seconds_until(lambda g=gateway: ready(g)["engine"]["workers_up"] == 1, 15)
    cli = Cli(replicas.settings["DATABASE_URL"], replicas.scratch)
    cli.env.update(PREFIXGATE_KEY_HASH_SECRET=KEY_SECRET, PREFIXGATE_AUDIT_SIGNING_KEY=SIGNING_KEY)
    cli.ok("tenants", "delete", "doomed")
    cli.ok("tenants", "set-quota", "shrinking", "--quota", "32")
    time.sleep(0.5)  # every gateway heard of both and tried the worker in vain
    for gateway in replicas.gateways:
        gateway.kill()
    owners = worker_state(qwen)["stats"]["owners"]
    assert owners[ids["doomed"]]["cached_blocks"] > 0  # nobody could tell it
    assert owners[ids["shrinking"]]["quota_blocks"] == 64
    fresh = replicas.start_gateway()
    replicas.qwen_link.start()
    seconds_until(lambda: ready(fresh)["engine"]["workers_up"] == 2, 20)
    owners = worker_state(qwen)["stats"]["owners"]
    held = owners[ids["doomed"]]
    assert held["cached_blocks"] == 0 and held["active_blocks"] == 0
    assert owners[ids["shrinking"]]["quota_blocks"] == 32
