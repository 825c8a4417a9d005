"""Routing weighs a worker by the queue a request of its tenant would wait in there: its own
tenant's sequences plus one share per other tenant with work there. Real dispatcher picks over
workers as a gateway knows them (no processes), and the reports workers send."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.cache.block_hash import BlockHasher
from engine.cache.scope import Segment, User
from engine.metrics import TenantService
from engine.request import GenerationRequest
from gateway.workers import routing
from gateway.workers.activity import RECENT_STEPS, Activity, quantiles, read_activity, total_service
from gateway.workers.dispatch import Dispatcher
from gateway.workers.key_log import KeyDigest
from gateway.workers.link import WorkerLink
from gateway.workers.membership import WorkerSet
from gateway.workers.routing import RoutingConfig
from gateway.workers.worker import Worker

BLOCK = 4
ROOT = BlockHasher(BLOCK).root("model", "", "float32")
SIGNING_KEY = "s" * 32
DIGEST = KeyDigest(SIGNING_KEY)  # what the workers publish under, as the link below computes
PROMPT = 64  # tokens: 15 full blocks before the last one can be cached


def request(tenant: str, prefix: int, suffix: int = 0) -> GenerationRequest:
    """A 64-token prompt of `tenant` whose first tokens are those of prefix `prefix`."""
    tokens = [prefix] * (PROMPT - 4) + [suffix] * 4
    segments = [Segment(0, PROMPT, User(tenant, "u"))]
    return GenerationRequest(f"r-{tenant}-{prefix}-{suffix}", tenant, tokens, segments=segments)


def worker(url: str, holds: tuple[GenerationRequest, ...] = ()) -> Worker:
    """A worker in routing that reports its tenants and caches the prompts of `holds`."""
    keys = {key for held in holds for key in routing.request_keys(held, ROOT, BLOCK, DIGEST)}
    return Worker(
        url,
        up=True,
        lost=False,
        fingerprint="fp",
        keys=keys,
        free_blocks=1000,
        state={"root": ROOT.hex(), "block_size": BLOCK},
        activity=Activity(tenant_sequences={}),
    )


@pytest.fixture
def workers() -> Iterator[WorkerSet]:
    link = WorkerLink.create("worker-secret", SIGNING_KEY, tls=None)  # never dials a worker
    known = WorkerSet([], link, poll_s=1.0, timeout_s=1.0, load_models=False)
    yield known
    known.stop()


def dispatcher(workers: WorkerSet, *known: Worker, load_tokens: int, imbalance: int) -> Dispatcher:
    workers.workers = {w.url: w for w in known}
    return Dispatcher(workers, RoutingConfig("cache_aware", load_tokens, imbalance))


def pick(dispatch: Dispatcher, asked: GenerationRequest) -> str:
    """Where the dispatcher sends `asked` (its sequences now count there, as in a stream)."""
    return dispatch._pick(asked, set(), "fp").url


def flood(at: Worker, tenant: str, sequences: int) -> None:
    for _ in range(sequences):
        at.send(tenant, 1)


@pytest.mark.parametrize(("load_tokens", "imbalance"), [(16, 100), (0, 8)])
def test_a_flood_does_not_repel_another_tenant_from_the_worker_holding_its_prefix(
    workers: WorkerSet, load_tokens: int, imbalance: int
) -> None:
    """Once by the load term of the cost, once by the imbalance rule alone."""
    acme = request("acme", prefix=7)
    holder, idle = worker("http://holder:1", holds=(acme,)), worker("http://idle:1")
    dispatch = dispatcher(workers, holder, idle, load_tokens=load_tokens, imbalance=imbalance)
    flood(holder, "globex", 10)
    assert pick(dispatch, request("acme", prefix=7, suffix=1)) == holder.url
    assert holder.load_for("acme") == 2 and holder.tenant_in_flight == {"globex": 10, "acme": 1}
    # Counted by everything in flight, as before, the flood would have sent it away.
    candidates = [
        routing.Candidate(w.url, w.held(0.0), w.load, w.free_blocks, routing.request_keys(
            acme, ROOT, BLOCK, DIGEST)) for w in (holder, idle)
    ]  # fmt: skip
    ranked = routing.rank(candidates, PROMPT, BLOCK, load_tokens, imbalance, sticky="s")
    assert ranked[0].name == idle.url


def test_a_flooding_tenants_own_requests_spread_by_its_own_load(workers: WorkerSet) -> None:
    globex = request("globex", prefix=9)
    holder, idle = worker("http://holder:1", holds=(globex,)), worker("http://idle:1")
    dispatch = dispatcher(workers, holder, idle, load_tokens=16, imbalance=100)
    acme_there = request("acme", prefix=3)
    holder.keys |= set(routing.request_keys(acme_there, ROOT, BLOCK, DIGEST))
    for index in range(12):
        pick(dispatch, request("globex", prefix=9, suffix=index))
    there, elsewhere = holder.tenant_in_flight["globex"], idle.tenant_in_flight["globex"]
    # 60 cached tokens are worth 3.75 of its own sequences (16 tokens each): the fifth goes
    # elsewhere, which from then on holds the prefix too, and the flood splits evenly.
    assert (there, elsewhere) == (6, 6)
    # The other tenant still goes where its prefix is: both workers have one tenant at work.
    assert pick(dispatch, request("acme", prefix=3, suffix=1)) == holder.url


def test_other_gateways_work_counts_per_tenant_as_last_polled() -> None:
    polled = worker("http://w:1")
    polled.activity = Activity(tenant_sequences={"globex": 5, "acme": 2})
    polled.own_tenants_at_poll = {"globex": 3}  # three of globex's five were this gateway's
    flood(polled, "globex", 4)  # one more sent since
    assert polled.tenant_loads() == {"globex": 6, "acme": 2}
    assert polled.load_for("acme") == 2 + 1
    assert polled.load_for("globex") == 6 + 1
    assert polled.load_for("initech") == 2  # two tenants at work, none of its own
    polled.release("globex", 4)
    assert polled.tenant_in_flight == {} and polled.in_flight == 0
    assert polled.tenant_loads() == {"globex": 2, "acme": 2}


def test_a_worker_of_the_previous_version_is_weighed_by_everything_in_flight() -> None:
    old_state = {"ready": True, "in_flight": 5, "describe": {"dtype": "float32"}}
    report = read_activity(old_state)
    assert report == Activity()  # no tenants, no service, no steps, no target
    old = worker("http://old:1")
    old.activity, old.reported_load = report, 5
    flood(old, "acme", 2)
    assert old.load_for("globex") == old.load_for("acme") == old.load == 7


def test_an_unreadable_report_counts_as_not_sent() -> None:
    garbled = {
        "tenant_sequences": ["acme"],
        "service": {"acme": {"prefill_tokens": "many"}},
        "steps": {"count": 3},
        "describe": {"step_cost": "fast"},
    }
    assert read_activity(garbled) == Activity()


def test_a_report_is_read_bounded_and_without_idle_tenants() -> None:
    state = {
        "tenant_sequences": {"acme": 3, "globex": 0},
        "service": {"acme": {"prefill_tokens": 10, "decode_tokens": 4, "service": 22.5}},
        "steps": {"count": 9000, "seconds_total": 12.5, "recent": [0.01] * (RECENT_STEPS + 50)},
        "describe": {"step_cost": {"target_ms": 50.0, "fixed_ms": 2.0}},
    }
    report = read_activity(state)
    assert report.tenant_sequences == {"acme": 3}
    assert report.service == {"acme": TenantService(10, 4, 22.5)}
    assert (report.steps.steps, report.steps.seconds_total) == (9000, 12.5)
    assert len(report.steps.recent) == RECENT_STEPS
    assert report.step_target_ms == 50.0


def test_service_adds_up_over_workers_and_quantiles_are_nearest_rank() -> None:
    a = {"acme": TenantService(10, 2, 14.0)}
    b = {"acme": TenantService(5, 1, 7.0), "globex": TenantService(1, 0, 1.0)}
    assert total_service([a, b]) == {
        "acme": TenantService(15, 3, 21.0),
        "globex": TenantService(1, 0, 1.0),
    }
    assert quantiles([float(n) for n in range(100, 0, -1)]) == {0.5: 50.0, 0.99: 99.0}
    assert quantiles([0.2]) == {0.5: 0.2, 0.99: 0.2}
    assert quantiles([]) == {}
