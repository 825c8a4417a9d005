"""Two real `prefixgate worker` processes behind a real gateway (PostgreSQL, uvicorn, the
official `openai` client): routing keeps cache hits, scopes and quotas hold across workers, and
a worker that dies takes down nothing but its own streams."""

from __future__ import annotations

import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.local_workers import (
    SIGNING_KEY,
    LocalWorker,
    gateway_context,
    make_certificates,
    session_certificates,
    worker_processes,
)
from bench.routing import Workloads, kv_cache_bytes, run_chats, run_gsp
from engine.cache.block_hash import BlockHash, BlockHasher, encode_token_ids
from engine.cache.scope import Segment, Tenant
from engine.request import GenerationRequest
from engine.sampling.sampler import SamplingParams
from gateway.workers import wire
from gateway.workers.key_log import KEY_PREFIX_BYTES, KeyDigest
from gateway.workers.remote_engine import RemoteEngine
from gateway.workers.signing import SIGNATURE_HEADER, RequestSigner, generation_view
from gateway.workers.wire import read_stats
from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client
from tests.support.browser import ConsoleSession
from tests.support.gateway import (
    METRICS_TOKEN,
    MODEL,
    SYSTEM_PROMPT,
    Gateway,
    openai_client,
    start_gateway,
)
from tests.support.tcp_proxy import TcpProxy

SECRET = "scale-out-test-worker-secret"
# One request at a time: round robin's turns then alternate strictly, so both shares are the
# same on every run (with requests side by side they vary by +-0.1).
SIZES = Workloads(groups=6, per_group=5, system_words=120, conversations=6, turns=4, concurrency=1)
TENANTS = [
    *[(slug, "tenant", TenantLimits()) for slug in SIZES.gsp_tenants()],
    ("chat", "user", TenantLimits()),
    ("acme", "user", TenantLimits()),
    ("globex", "user", TenantLimits()),
]


@contextmanager
def routed(
    template: str, model_dir: Path, state_dir: Path, kv_bytes: int, **settings: Any
) -> Iterator[tuple[Gateway, list[LocalWorker]]]:
    environment = {
        "PREFIXGATE_KV_CACHE_BYTES": str(kv_bytes),
        "PREFIXGATE_DTYPE": "float32",
        "OMP_NUM_THREADS": "1",
    }
    with ExitStack() as stack:
        workers = stack.enter_context(
            worker_processes(2, model_dir, SECRET, state_dir, environment=environment)
        )
        options = {
            "workers": [worker.url for worker in workers],
            "worker_secret": SECRET,
            "worker_poll_s": 0.25,
            "worker_timeout_s": 2.0,
            **session_certificates().gateway_settings(),
            **settings,
        }
        gateway = stack.enter_context(
            start_gateway(template, model_dir, state_dir, TENANTS, **options)
        )
        yield gateway, workers


@pytest.fixture(scope="module")
def cluster(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, list[LocalWorker]]]:
    """Cache-aware routing over two workers, shared by the tests that kill nothing."""
    state_dir = tmp_path_factory.mktemp("routed")
    with routed(migrated_template, tiny_chat_dir, state_dir, 16 << 20) as started:
        yield started


def cached_tokens(gateway: Gateway, tenant: str, user: str, messages: list[Any]) -> int:
    response = openai_client(gateway, tenant).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, user=user
    )
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return response.usage.prompt_tokens_details.cached_tokens or 0


def test_cache_aware_routing_keeps_more_prompt_tokens_cached_than_round_robin(
    migrated_template: str, tiny_chat_dir: Path, tmp_path: Path
) -> None:
    kv_bytes = kv_cache_bytes(tiny_chat_dir, SIZES, None)  # one worker cannot hold every group
    shares: dict[str, dict[str, float]] = {}
    for mode in ("round_robin", "cache_aware"):
        state_dir = tmp_path / mode
        state_dir.mkdir()
        with routed(migrated_template, tiny_chat_dir, state_dir, kv_bytes, routing=mode) as (
            gateway,
            _,
        ):
            gsp = run_gsp(gateway.server.url, gateway.keys, MODEL, SIZES)
            chats = run_chats(gateway.server.url, gateway.keys["chat"], MODEL, SIZES)
        assert not gsp.failures and not chats.failures, (gsp.failures, chats.failures)
        assert gsp.requests == SIZES.groups * SIZES.per_group
        assert chats.requests == SIZES.conversations * SIZES.turns
        shares[mode] = {"gsp": gsp.share, "chat": chats.share}
    print(f"cached share of prompt tokens: {shares}")
    for workload in ("gsp", "chat"):
        aware, robin = shares["cache_aware"][workload], shares["round_robin"][workload]
        assert aware >= robin + 0.1, f"{workload}: cache-aware {aware:.3f}, round robin {robin:.3f}"


def test_no_tenant_is_drawn_to_another_tenants_private_prefix(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, _ = cluster
    private = [{"role": "user", "content": "Internal roadmap of acme for the next year. " * 6}]
    assert cached_tokens(gateway, "acme", "alice", private) == 0
    time.sleep(0.6)  # the workers publish the new keys with their next poll
    assert cached_tokens(gateway, "acme", "alice", private) > 0  # routed to its own blocks
    assert cached_tokens(gateway, "globex", "alice", private) == 0  # same user id, other tenant
    assert cached_tokens(gateway, "acme", "bob", private) == 0  # same tenant, other user


def test_workers_publish_the_keys_they_cache(cluster: tuple[Gateway, list[LocalWorker]]) -> None:
    """Published keys, not only those the gateway just sent (another gateway relies on them)."""
    gateway, _ = cluster
    engine = gateway.server.gateway.engine
    assert isinstance(engine, RemoteEngine)

    def sent() -> dict[str, set[str]]:  # keys the gateway counts as held since it sent them
        return dict(engine.workers.snapshot(lambda w: (w.url, set(w.pending))))

    def published() -> dict[str, set[str]]:
        return dict(engine.workers.snapshot(lambda w: (w.url, set(w.keys))))

    before = sent()
    message = {"role": "user", "content": "A private note to publish, block by block. " * 16}
    assert cached_tokens(gateway, "acme", "publisher", [message]) == 0
    after = sent()
    ours = {url: after[url] - before.get(url, set()) for url in after}
    served = [url for url, keys in ours.items() if keys]
    assert len(served) == 1 and len(ours[served[0]]) >= 8  # about 10 blocks of 16 tokens
    mine = ours[served[0]]
    within(5, lambda: mine <= published()[served[0]])  # the worker published them itself
    assert not any(mine & keys for url, keys in published().items() if url != served[0])


def test_a_public_system_prompt_is_reused_across_tenants_through_the_router(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, _ = cluster

    def chat(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]

    cached_tokens(gateway, "acme", "alice", chat("Can I change my seat?"))
    time.sleep(0.6)
    # Every later request lands where the registered prompt's blocks are.
    hits = [
        cached_tokens(gateway, tenant, "someone", chat(f"Question {index} about luggage?"))
        for index, tenant in enumerate(["globex", "chat", "globex", "acme"])
    ]
    assert all(hit > 0 for hit in hits), hits


def test_quotas_hold_on_every_worker_and_the_admin_api_shows_both(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, workers = cluster
    with admin_client(gateway) as admin:
        tenant = next(t for t in admin.get("/tenants").json()["data"] if t["slug"] == "globex")
        answer = admin.put(f"/tenants/{tenant['id']}/quota", json={"quota_blocks": 24})
        assert answer.status_code == 200, answer.text

        def on_every_worker() -> bool:
            quotas = [worker_quota(worker, tenant["id"]) for worker in workers]
            return quotas == [24, 24]

        within(5, on_every_worker)
        gateway.server.gateway.engine.workers.poll_once()  # type: ignore[union-attr]
        cache = admin.get(f"/tenants/{tenant['id']}").json()["cache"]
    assert [row["quota_blocks"] for row in cache["workers"]] == [24, 24]
    assert {row["worker"] for row in cache["workers"]} == {w.url for w in workers}
    assert cache["quota_blocks"] == 48  # the total over both workers
    with ConsoleSession(gateway) as console:
        page = console.get(f"/admin/tenants/{tenant['id']}").text
    table = page[page.index('<table id="worker-cache">') :]
    table = table[: table.index("</table>")]
    assert all(worker.url in table for worker in workers)
    assert table.count("<td>24</td>") == 2  # the quota, on each worker
    # Both workers serve one model: one pool, and the quota holds in it on each worker.
    assert [(pool["model"], pool["quota_blocks"]) for pool in cache["pools"]] == [(MODEL, 48)]
    assert {row["model"] for row in cache["workers"]} == {MODEL}
    with admin_client(gateway) as admin:
        (pool,) = admin.get("/pools").json()["pools"]
    assert pool["model"] == MODEL and pool["served"]
    assert {w["url"] for w in pool["workers"]} == {w.url for w in workers}
    assert all(w["up"] for w in pool["workers"])
    assert pool["total_blocks"] == sum(worker_state(w)["stats"]["num_blocks"] for w in workers)
    with admin_client(gateway, gateway.tenant_admin_keys["globex"]) as own:
        (mine,) = own.get("/pools").json()["pools"]
    assert mine["workers"] is None and [row["slug"] for row in mine["owners"]] == ["globex"]
    assert mine["owners"][0]["quota_blocks"] == 48


def test_metrics_list_each_worker(cluster: tuple[Gateway, list[LocalWorker]]) -> None:
    gateway, workers = cluster
    text = httpx.get(f"{gateway.server.url}/metrics").text
    for worker in workers:
        assert f'prefixgate_worker_up{{worker="{worker.url}"}} 1.0' in text


def test_readyz_reports_the_engine_choices_the_workers_share(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, workers = cluster
    engine = gateway_ready(gateway)["engine"]
    own = [worker_state(worker)["describe"] for worker in workers]
    for key in ("dtype", "kv_dtype", "logits_dtype", "attention_backend", "linear_kernel"):
        assert engine[key] == own[0][key] == own[1][key] is not None, key


def worker_state(worker: LocalWorker) -> dict[str, Any]:
    """The worker's own account of itself (its state endpoint, with the secret)."""
    answer = worker.request(
        "GET", "/internal/v1/state", headers={"Authorization": f"Bearer {SECRET}"}
    )
    assert answer.status_code == 200, answer.text
    state: dict[str, Any] = answer.json()
    return state


def worker_quota(worker: LocalWorker, tenant_id: str) -> int | None:
    state = worker_state(worker)
    owner = state["stats"]["owners"].get(tenant_id)
    return None if owner is None else int(owner["quota_blocks"])


def test_the_worker_api_needs_the_secret_and_refuses_garbage(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    _, workers = cluster
    worker = workers[0]
    assert worker.request("GET", "/healthz").status_code == 200
    assert worker.request("GET", "/readyz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET + "x"}):
        answer = worker.request("POST", "/internal/v1/generate", json={}, headers=headers)
        assert answer.status_code == 401, answer.text
        assert worker.request("GET", "/internal/v1/state", headers=headers).status_code == 401
        assert worker.request("GET", "/internal/v1/model", headers=headers).status_code == 401
    good = {"Authorization": f"Bearer {SECRET}"}
    # What a gateway fetches to serve the worker's model: its tokenizer and config, no weights.
    model = worker.request("GET", "/internal/v1/model", headers=good).json()
    assert model["name"] == MODEL and len(model["fingerprint"]) == 64
    assert {"config.json", "tokenizer.json"} <= set(model["files"])
    assert not [name for name in model["files"] if name.endswith((".safetensors", ".bin"))]
    assert "im_start" in model["chat_template"]
    for body in (b"not json", b"[1, 2]"):
        answer = worker.request("POST", "/internal/v1/generate", content=body, headers=good)
        assert answer.status_code == 400, answer.text
        assert "error" in answer.json()
    # A JSON object with the right secret but no gateway's signature: refused before parsing.
    unsigned = b'{"prompt_token_ids": "x"}'
    answer = worker.request("POST", "/internal/v1/generate", content=unsigned, headers=good)
    assert answer.status_code == 403, answer.text
    assert worker.request("GET", "/openapi.json").status_code == 404  # nothing advertised


def test_a_client_that_leaves_mid_stream_cancels_its_request_on_the_worker(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, workers = cluster
    body = {
        "model": MODEL, "stream": True, "max_tokens": 1500, "temperature": 0.9,
        "logit_bias": {"2": -100},  # no sampled end of sequence: the answer runs its length
        "messages": [{"role": "user", "content": "Write a very long story."}],
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {gateway.keys['acme']}"}
    started = time.monotonic()  # the whole answer, for comparison
    whole = httpx.post(
        f"{gateway.server.url}/v1/chat/completions", json={**body, "stream": False},
        headers=headers, timeout=120,
    ).json()  # fmt: skip
    whole_s = time.monotonic() - started
    assert whole["usage"]["completion_tokens"] > 1000
    with (
        httpx.Client(base_url=gateway.server.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert sum(worker_in_flight(worker) for worker in workers) == 1
    left = time.monotonic()
    within(whole_s, lambda: sum(worker_in_flight(worker) for worker in workers) == 0)
    # Cancelled, not finished: the worker let go well before the whole answer's time.
    assert time.monotonic() - left < whole_s / 2, (time.monotonic() - left, whole_s)


def worker_in_flight(worker: LocalWorker) -> int:
    state = worker_state(worker)
    return int(state["in_flight"])


def test_client_mistakes_get_the_same_answers_as_in_one_process(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    gateway, _ = cluster
    client = openai_client(gateway, "acme")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 1400}], max_tokens=1000
        )
    assert too_long.value.code == "context_length_exceeded"
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=12,
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    assert (answer.choices[0].message.content or "").lstrip().startswith("{")
    streamed = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, stream=True,
        n=2, temperature=0,
    )  # fmt: skip
    finished = {c.index for chunk in streamed for c in chunk.choices if c.finish_reason}
    assert finished == {0, 1}


def test_a_killed_worker_leaves_the_gateway_serving_and_no_request_hangs(
    migrated_template: str, tiny_chat_dir: Path, tmp_path: Path
) -> None:
    with routed(migrated_template, tiny_chat_dir, tmp_path, 16 << 20) as (gateway, workers):
        outcomes: list[tuple[float, float, str]] = []  # (sent, answered, outcome)
        lock = threading.Lock()
        stop = threading.Event()
        client = openai.OpenAI(
            base_url=gateway.base_url, api_key=gateway.keys["acme"], max_retries=0, timeout=60
        )

        def keep_asking(index: int) -> None:
            turn = 0
            while not stop.is_set():
                turn += 1
                sent = time.monotonic()
                try:
                    answer = client.chat.completions.create(
                        model=MODEL, max_tokens=48, temperature=0, user=f"user-{index}",
                        messages=[{"role": "user", "content": f"Tell me a story {index} {turn}."}],
                        stream=index % 2 == 0,
                    )  # fmt: skip
                    if index % 2 == 0:
                        list(answer)  # type: ignore[call-overload]
                    outcome = "ok"
                except openai.APIStatusError as error:
                    outcome = f"{error.status_code}"
                except openai.APIError as error:  # a stream that ended with an error event
                    outcome = f"stream error: {error.message}"
                with lock:
                    outcomes.append((sent, time.monotonic(), outcome))

        with ThreadPoolExecutor(6) as pool:
            try:
                for index in range(6):
                    pool.submit(keep_asking, index)
                time.sleep(2)
                killed_at = time.monotonic()
                workers[0].kill()
                within(5, lambda: gateway_workers_up(gateway) == 1)
                noticed_at = time.monotonic()
                metrics = httpx.get(f"{gateway.server.url}/metrics").text
                assert f'prefixgate_worker_up{{worker="{workers[0].url}"}} 0.0' in metrics
                time.sleep(3)
            finally:  # the askers stop whatever failed above, or the pool waits for ever
                stop.set()
        assert all(answered - sent < 30 for sent, answered, _ in outcomes)  # none hung
        before = [o for sent, _, o in outcomes if sent < killed_at]
        after = [o for sent, _, o in outcomes if sent > noticed_at]
        failed = [o for _, _, o in outcomes if o != "ok"]
        print(f"{len(before)} sent before the kill, {len(after)} after it was noticed: {failed}")
        assert before and after
        assert all(outcome == "ok" for outcome in after), after
        # Those in flight at the kill either moved to the other worker (nothing streamed yet)
        # or failed with a clean OpenAI error, never a hang or a dropped connection.
        assert all(o in ("500", "503") or o.startswith("stream error") for o in failed), failed
        assert len(failed) <= 6


def test_a_worker_that_was_away_gets_the_purge_it_missed_before_it_serves_again(
    migrated_template: str, tiny_chat_dir: Path, tmp_path: Path
) -> None:
    environment = {"PREFIXGATE_DTYPE": "float32", "OMP_NUM_THREADS": "1"}
    with ExitStack() as stack:
        workers = stack.enter_context(
            worker_processes(2, tiny_chat_dir, SECRET, tmp_path, environment=environment)
        )
        host, port = workers[1].url.removeprefix("https://").split(":")
        link = TcpProxy(host, int(port)).start()  # the network between gateway and worker 1
        stack.callback(link.stop)
        gateway = stack.enter_context(
            start_gateway(
                migrated_template, tiny_chat_dir, tmp_path, TENANTS,
                workers=[workers[0].url, f"https://127.0.0.1:{link.port}"],
                worker_secret=SECRET, worker_poll_s=0.25, worker_timeout_s=2.0,
                **session_certificates().gateway_settings(),
            )
        )  # fmt: skip
        # Private conversations of many users: by rendezvous hashing, some land on each worker.
        for index in range(12):
            message = {"role": "user", "content": f"Secret plan number {index}. " * 10}
            cached_tokens(gateway, "globex", f"user-{index}", [message])
        tenant_id = gateway_tenant_id(gateway, "globex")
        assert all(cached_blocks(worker, tenant_id) > 0 for worker in workers)
        link.stop()
        within(5, lambda: gateway_workers_up(gateway) == 1)
        with admin_client(gateway) as admin:
            assert admin.delete(f"/tenants/{tenant_id}").status_code == 204
        within(5, lambda: cached_blocks(workers[0], tenant_id) == 0)
        assert cached_blocks(workers[1], tenant_id) > 0  # away: it could not be told
        link.start()
        within(10, lambda: gateway_workers_up(gateway) == 2)
        assert cached_blocks(workers[1], tenant_id) == 0  # told before it was routable again


def test_a_worker_that_hangs_is_dropped_and_a_drained_one_takes_no_new_requests(
    migrated_template: str, tiny_chat_dir: Path, tmp_path: Path
) -> None:
    """SIGSTOP: the worker keeps its sockets open and answers nothing, as a hung machine."""
    with routed(migrated_template, tiny_chat_dir, tmp_path, 16 << 20) as (gateway, workers):
        client = openai.OpenAI(
            base_url=gateway.base_url, api_key=gateway.keys["acme"], max_retries=0, timeout=60
        )

        def ask(index: int) -> str:
            try:
                client.chat.completions.create(
                    model=MODEL, max_tokens=32, temperature=0, user=f"user-{index}",
                    messages=[{"role": "user", "content": f"Tell me a story {index}."}],
                )  # fmt: skip
                return "ok"
            except openai.APIStatusError as error:
                return str(error.status_code)

        hung = workers[0]
        hung.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                outcomes = list(pool.map(ask, range(8)))
            # Those sent to the hung worker moved on once it was dropped (nothing had streamed).
            assert outcomes == ["ok"] * 8, outcomes
            assert time.monotonic() - started < 20
            assert gateway_workers_up(gateway) == 1
        finally:
            hung.process.send_signal(signal.SIGCONT)
        within(10, lambda: gateway_workers_up(gateway) == 2)
        # Drain the worker that serves a long stream: the stream finishes there, new requests
        # go to the other one.
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(long_stream, client)
            within(10, lambda: any(worker_in_flight(w) for w in workers))
            busy = next(w for w in workers if worker_in_flight(w))
            drained = busy.request(
                "POST", "/internal/v1/drain", headers={"Authorization": f"Bearer {SECRET}"}
            )
            assert drained.status_code == 200
            within(5, lambda: gateway_workers_up(gateway) == 1)
            assert [ask(index) for index in range(4)] == ["ok"] * 4
            assert streaming.result(timeout=60) == "length"  # whole, not cut off
        assert busy.request("GET", "/readyz").status_code == 503


def long_stream(client: openai.OpenAI) -> str | None:
    """Stream a long answer to its end; the last choice's finish reason.

    The end-of-sequence token (2) is biased away: a sampled one would end the stream early with
    "stop", and the test asserts the whole stream, to max_tokens.
    """
    chunks = client.chat.completions.create(
        model=MODEL, max_tokens=1200, temperature=0.9, stream=True, logit_bias={"2": -100},
        messages=[{"role": "user", "content": "Write a very long story."}],
    )  # fmt: skip
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return reasons[-1] if reasons else None


def gateway_tenant_id(gateway: Gateway, slug: str) -> str:
    with admin_client(gateway) as admin:
        tenant = next(t for t in admin.get("/tenants").json()["data"] if t["slug"] == slug)
    return str(tenant["id"])


def cached_blocks(worker: LocalWorker, tenant_id: str) -> int:
    state = worker_state(worker)
    owner = state["stats"]["owners"].get(tenant_id)
    return 0 if owner is None else int(owner["cached_blocks"]) + int(owner["active_blocks"])


def gateway_ready(gateway: Gateway) -> dict[str, Any]:
    """The gateway's /readyz as the metrics scraper sees it (anyone else gets the status)."""
    answer = httpx.get(
        f"{gateway.server.url}/readyz",
        headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
        timeout=10,
    )
    ready: dict[str, Any] = answer.json()
    assert "engine" in ready, ready  # the token was taken: the details are there
    return ready


def gateway_workers_up(gateway: Gateway) -> int:
    return int(gateway_ready(gateway)["engine"]["workers_up"])


def within(seconds: float, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def signed_generation(
    fingerprint: str, tenant_id: str, token_ids: list[int]
) -> tuple[dict[str, Any], dict[str, str]]:
    """A generation of `tenant_id`'s private scope, signed as a gateway signs it."""
    request = GenerationRequest(
        request_id=f"probe-{len(token_ids)}-{token_ids[-1]}",
        tenant_id=tenant_id,
        prompt_token_ids=token_ids,
        sampling=SamplingParams(max_tokens=1),
        segments=[Segment(0, len(token_ids), Tenant(tenant_id))],
        tail_scope=Tenant(tenant_id),
    )
    body = wire.request_json(request)
    signature = RequestSigner(SIGNING_KEY).sign(generation_view(body, fingerprint))
    return body, {"Authorization": f"Bearer {SECRET}", SIGNATURE_HEADER: signature}


def generate_status(worker: LocalWorker, body: dict[str, Any], headers: dict[str, str]) -> int:
    answer = worker.request("POST", "/internal/v1/generate", json=body, headers=headers)
    return answer.status_code


def test_the_secret_alone_cannot_ask_for_a_tenants_cache(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    """The membership oracle a stolen secret gave: the right secret (and a gateway's
    certificate) with a forged, missing, copied or replayed signature is refused before the
    engine."""
    _, workers = cluster
    worker = workers[0]
    fingerprint = worker_state(worker)["fingerprint"]
    prompt = list(range(300, 300 + 96))
    body, headers = signed_generation(fingerprint, "victim", prompt)
    assert generate_status(worker, body, headers) == 200  # a gateway's own request
    seen = prompt_tokens_counted(worker)
    guess = [*prompt[:-1], prompt[-1] + 1]  # a one-word change, the signature copied
    attempts = [
        ({**body, "prompt_token_ids": guess}, headers),
        (body, {"Authorization": headers["Authorization"]}),  # no signature
        (body, {**headers, SIGNATURE_HEADER: "0" * 64}),  # a forged one
        ({**body, "tenant_id": "attacker"}, headers),  # another tenant's budget
        ({**body, "tail_scope": {"kind": "tenant", "tenant_id": "other"}}, headers),
        ({**body, "sampling": {**body["sampling"], "max_tokens": 512}}, headers),  # reshaped
        (body, headers),  # the gateway's own request, replayed
    ]
    for attempt, attempt_headers in attempts:
        assert generate_status(worker, attempt, attempt_headers) == 403
    # Signed for this model only: the same request signed for other weights is refused too.
    _, other_model = signed_generation("0" * 64, "victim", prompt)
    assert generate_status(worker, body, other_model) == 403
    assert prompt_tokens_counted(worker) == seen  # none of them reached the engine
    # Admin actions that take a tenant are signed as well.
    purge = {"tenant_id": "victim"}
    secret_only = {"Authorization": f"Bearer {SECRET}"}
    refused = worker.request("POST", "/internal/v1/purge", json=purge, headers=secret_only)
    assert refused.status_code == 403
    signed = worker.request("POST", "/internal/v1/purge", json=purge, signed=(SECRET, "purge"))
    assert signed.status_code == 200, signed.text


def test_published_keys_confirm_no_guess_without_the_signing_key(
    cluster: tuple[Gateway, list[LocalWorker]],
) -> None:
    """/internal/v1/state, read with a gateway's certificate and the secret but not the signing
    key, lists the blocks a worker caches in a form no guessed prompt can be checked against:
    the worker publishes digests under the signing key, never the block keys themselves."""
    _, workers = cluster
    worker = workers[0]
    state = worker_state(worker)
    prompt = list(range(700, 700 + 96))
    body, headers = signed_generation(state["fingerprint"], "secret-keeper", prompt)
    assert generate_status(worker, body, headers) == 200
    # The keys of the prompt's full blocks (all but the last token's), as anyone can compute
    # them from a guess: the model's root, the scope and the token ids.
    block_size = int(state["block_size"])
    chain = BlockHasher(block_size).chain(
        BlockHash(bytes.fromhex(state["root"])),
        encode_token_ids(prompt),
        [Tenant("secret-keeper")] * (len(prompt) // block_size),
        end_block=(len(prompt) - 1) // block_size,
    )
    assert len(chain) >= 4
    keyed = {KeyDigest(SIGNING_KEY)(key) for key in chain}
    within(5, lambda: keyed <= set(worker_state(worker)["keys"]["added"]))  # cached, published
    published = set(worker_state(worker)["keys"]["added"])
    assert not {key[:KEY_PREFIX_BYTES].hex() for key in chain} & published
    assert not {KeyDigest("a guess at the signing key, 32+ chars")(k) for k in chain} & published


def prompt_tokens_counted(worker: LocalWorker) -> int:
    """Prompt tokens the worker's engine has been asked for (its tenants' counters)."""
    return read_stats(worker_state(worker)["stats"]).prompt_tokens


def test_only_clients_with_a_certificate_the_ca_signed_reach_a_worker(
    cluster: tuple[Gateway, list[LocalWorker]], tmp_path: Path
) -> None:
    _, workers = cluster
    worker = workers[0]
    ours = session_certificates()
    stranger = make_certificates(tmp_path / "other-ca")  # a CA the workers never heard of
    secret = {"Authorization": f"Bearer {SECRET}"}
    # No client certificate: the handshake fails, whatever the secret.
    anonymous = ssl.create_default_context(cafile=ours.ca)
    anonymous.check_hostname = False
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{worker.url}/internal/v1/state", headers=secret, verify=anonymous)
    # A client certificate another CA signed.
    foreign = gateway_context(stranger)
    foreign.load_verify_locations(cafile=ours.ca)  # it trusts the worker; the worker not it
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{worker.url}/internal/v1/state", headers=secret, verify=foreign)
    # A worker's own certificate is a server's only: it cannot call another worker.
    as_worker = ssl.create_default_context(cafile=ours.ca)
    as_worker.check_hostname = False
    as_worker.load_cert_chain(ours.directory / "worker.pem", ours.directory / "worker.key")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{worker.url}/internal/v1/state", headers=secret, verify=as_worker)
    # And a gateway accepts only workers of its own CA.
    with pytest.raises(httpx.HTTPError):
        worker.request("GET", "/internal/v1/state", certificates=stranger, headers=secret)
    # Plain HTTP gets no answer from a TLS worker.
    with pytest.raises(httpx.HTTPError):
        httpx.get(worker.url.replace("https://", "http://") + "/healthz", timeout=5)
    assert worker.request("GET", "/internal/v1/state", headers=secret).status_code == 200
