"""Scheduler and engine loop: chunked prefill, preemption, quotas, cancellation, I6."""

from __future__ import annotations

import hashlib

import pytest
import torch

from engine.cache.block_hash import BlockHasher, HashObject, encode_token_ids
from engine.cache.budget import TenantBudget
from engine.cache.scope import Public, Segment, User
from engine.engine import Engine
from engine.errors import CacheQuotaTimeout, ContextTooLong, ExceedsCacheQuota, InvalidRequest
from engine.model.runner import Chunk
from engine.request import GenerationRequest
from engine.sampling.sampler import SamplingParams
from tests.engine.prompts import shared_prefix_requests, tokens
from tests.support.models import VOCAB, Collector, engine_for, make_request, run_all, run_one


class PositionCounter:
    """Counts, at the runner, which prompt positions the model really computes."""

    def __init__(self, engine: Engine, requests: list[GenerationRequest]) -> None:
        self.prompt_lens = {r.request_id: len(r.prompt_token_ids) for r in requests}
        self.computed: dict[str, set[int]] = {}
        self.batch_tokens: list[int] = []
        run = engine.runner.run

        def counting_run(chunks: list[Chunk]) -> torch.Tensor:
            self.batch_tokens.append(sum(len(chunk.token_ids) for chunk in chunks))
            for chunk in chunks:
                end = min(chunk.start + len(chunk.token_ids), self.prompt_lens[chunk.request_id])
                self.computed.setdefault(chunk.request_id, set()).update(range(chunk.start, end))
            return run(chunks)

        engine.runner.run = counting_run  # type: ignore[method-assign]


def test_reported_cached_tokens_equal_positions_the_runner_skipped() -> None:
    engine = engine_for("llama", num_blocks=40, max_num_batched_tokens=64)
    requests = shared_prefix_requests(tokens(1, 70), "ns", ["t0", "t1"], 8, 12, "r")
    requests.append(make_request("big", tokens(99, 300), tenant="t9", max_tokens=20))
    counter = PositionCounter(engine, requests)
    results = run_all(engine, requests)
    assert sum(result.usage.cached_tokens for result in results) > 0
    assert engine.metrics.preemptions > 0  # recomputed positions count once
    for request, result in zip(requests, results, strict=True):
        prompt = len(request.prompt_token_ids)
        assert result.usage.prompt_tokens == prompt
        computed = counter.computed[request.request_id]
        assert result.usage.cached_tokens == prompt - len(computed)


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = engine_for("llama", max_num_batched_tokens=32)
    request = make_request("long", tokens(2, 100), max_tokens=3)
    counter = PositionCounter(engine, [request])
    collector = Collector()
    engine.submit(request, collector)
    steps_to_first_token = 0
    while not collector.deltas:
        engine.step()
        steps_to_first_token += 1
    assert steps_to_first_token == 4  # 32 + 32 + 32 + 4
    while engine.step():
        pass
    assert max(counter.batch_tokens) <= 32
    assert collector.token_ids == run_one(engine_for("llama"), request).token_ids


def test_preemption_by_recompute_keeps_outputs_identical() -> None:
    requests = [make_request(f"r{i}", tokens(20 + i, 60), max_tokens=60) for i in range(3)]
    tight = engine_for("llama", num_blocks=14, enable_prefix_caching=False)
    results = run_all(tight, requests)
    assert tight.metrics.preemptions > 0
    roomy = engine_for("llama")
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == run_one(roomy, request).token_ids


def test_tenant_over_quota_waits_for_its_own_blocks_then_runs() -> None:
    engine = engine_for("llama")
    budget = TenantBudget(quota_blocks=8)
    first = make_request("first", tokens(3, 60), max_tokens=30)
    second = make_request("second", tokens(4, 60), max_tokens=4)
    first = GenerationRequest(**{**_fields(first), "budget": budget})
    second = GenerationRequest(**{**_fields(second), "budget": budget})
    one, two = run_all(engine, [first, second])
    # 'second' could only start once 'first' let go of its blocks.
    assert one.usage.completion_tokens == 30 and two.usage.completion_tokens == 4
    assert engine.cache_stats().owners["t1"].active_blocks == 0


def test_a_waiting_request_hashes_its_prompt_once_however_many_steps_it_waits() -> None:
    engine = engine_for("llama")
    hashed: list[bytes] = []

    def counting_hash(data: bytes) -> HashObject:
        hashed.append(bytes(data))
        return hashlib.blake2b(data)

    engine.cache.hasher = BlockHasher(engine.cache.block_size, counting_hash)
    budget = TenantBudget(quota_blocks=8)
    # 7 blocks held by the first while it runs, 4 wanted by the second: it waits for them.
    holder = with_budget(make_request("holder", tokens(3, 100), max_tokens=12), budget)
    prompt = tokens(4, 60)
    waiter = with_budget(make_request("waiter", prompt, max_tokens=4), budget)
    sinks = Collector(), Collector()
    engine.submit(holder, sinks[0])
    engine.submit(waiter, sinks[1])
    steps_waited = 0
    while engine.step():
        steps_waited += any(s.request_id == "waiter" for s in engine.scheduler.waiting)
    assert steps_waited >= 5 and all(sink.done and sink.error is None for sink in sinks)
    # The prompt's full blocks before its last token: each keyed once, at the first attempt.
    block = engine.cache.block_size
    for start in range(0, (len(prompt) - 1) // block * block, block):
        block_bytes = encode_token_ids(prompt[start : start + block])
        assert sum(data.endswith(block_bytes) for data in hashed) == 1


TENANT_ID = "0b5e7c2a-internal-tenant-id"


def test_request_waiting_on_its_tenants_full_quota_fails_typed_after_the_timeout() -> None:
    engine = engine_for("llama", queue_timeout_s=5.0)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    budget = TenantBudget(6)
    holder, waiter = Collector(), Collector()
    # Each fits the quota alone (6 and 4 blocks); together they cannot run at once.
    for request_id, seed, max_tokens, sink in (("a", 3, 30, holder), ("b", 4, 4, waiter)):
        request = make_request(
            request_id, tokens(seed, 60), tenant=TENANT_ID, max_tokens=max_tokens
        )
        engine.submit(with_budget(request, budget), sink)
    engine.step()
    assert waiter.error is None  # waiting, not failed
    now[0] = 6.0
    engine.step()
    assert isinstance(waiter.error, CacheQuotaTimeout)
    assert "quota" in str(waiter.error) and TENANT_ID not in str(waiter.error)
    assert holder.error is None


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "param", "needed_tokens"),
    [(100, 8, "messages", 112), (40, 40, "max_tokens", 80)],
)
def test_request_that_can_never_fit_its_quota_is_refused_at_submission(
    prompt_len: int, max_tokens: int, param: str, needed_tokens: int
) -> None:
    engine = engine_for("llama")
    request = make_request("big", tokens(5, prompt_len), tenant=TENANT_ID, max_tokens=max_tokens)
    with pytest.raises(ExceedsCacheQuota) as raised:
        engine.submit(with_budget(request, TenantBudget(4)), Collector())
    error = raised.value
    assert (error.param, error.needed_tokens, error.quota_tokens) == (param, needed_tokens, 64)
    assert TENANT_ID not in str(error) and "quota is 64 tokens" in str(error)
    assert not engine.scheduler.has_work()


def test_request_that_exactly_fits_its_quota_runs_to_the_end() -> None:
    engine = engine_for("llama")
    # 40 + 25 tokens, but the last one is never fed back: 64 positions, 4 blocks.
    request = make_request("edge", tokens(6, 40), tenant=TENANT_ID, max_tokens=25)
    result = run_one(engine, with_budget(request, TenantBudget(4)))
    assert result.usage.completion_tokens == 25


def test_public_prefix_blocks_do_not_count_against_the_tenants_quota() -> None:
    engine = engine_for("llama")
    prompt = tokens(7, 104)
    private = make_request("private", prompt, tenant=TENANT_ID, max_tokens=8)
    with pytest.raises(ExceedsCacheQuota):  # 7 blocks, all the tenant's
        engine.submit(with_budget(private, TenantBudget(4)), Collector())
    segments = [Segment(0, 64, Public("ns")), Segment(64, 104, User(TENANT_ID, "u1"))]
    shared = make_request("shared", prompt, tenant=TENANT_ID, max_tokens=8, segments=segments)
    result = run_one(engine, with_budget(shared, TenantBudget(4)))  # 4 public + 3 private
    assert result.usage.completion_tokens == 8


@pytest.mark.parametrize(
    ("config", "limit_text", "quota_tokens"),
    [
        ({"num_blocks": 8}, "the server's KV cache holds only 128 tokens", 128),
        ({"public_budget": TenantBudget(2)}, "the public cache budget is 32 tokens", 32),
    ],
)
def test_request_bigger_than_the_pool_or_public_budget_is_refused_at_submission(
    config: dict[str, object], limit_text: str, quota_tokens: int
) -> None:
    engine = engine_for("llama", **config)
    segments = [Segment(0, 64, Public("ns")), Segment(64, 100, User("t1", "u1"))]
    request = make_request("big", tokens(8, 100), max_tokens=40, segments=segments)
    with pytest.raises(ExceedsCacheQuota, match=limit_text) as raised:
        engine.submit(request, Collector())
    assert raised.value.quota_tokens == quota_tokens


def with_budget(request: GenerationRequest, budget: TenantBudget) -> GenerationRequest:
    return GenerationRequest(**{**_fields(request), "budget": budget})


def test_cancellation_frees_blocks_at_once() -> None:
    engine = engine_for("llama")
    collector = Collector()
    engine.submit(make_request("r", tokens(6, 50), max_tokens=100), collector)
    for _ in range(3):
        engine.step()
    assert engine.cache.num_blocks("r") > 0
    engine.cancel("r")
    engine.step()
    assert engine.pool.num_active == 0
    assert not engine.scheduler.has_work()
    assert engine.metrics.cancelled == 1


def test_stop_token_ids_and_max_tokens_finish_the_request() -> None:
    engine = engine_for("llama")
    prompt = tokens(7, 30)
    free_run = run_one(engine, make_request("free", prompt, max_tokens=10))
    assert free_run.deltas[-1].finish_reason == "length"
    assert free_run.usage.completion_tokens == 10
    stop_at = free_run.token_ids[3]
    stopped = run_one(
        engine,
        make_request("stop", prompt, sampling=SamplingParams(10, 0.0, stop_token_ids=(stop_at,))),
    )
    assert stopped.deltas[-1].finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop_at) + 1]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "error"),
    [
        ([], 5, InvalidRequest),
        ([VOCAB], 5, InvalidRequest),
        ([1] * 2040, 20, ContextTooLong),
    ],
)
def test_requests_that_can_never_run_are_refused_at_submission(
    prompt: list[int], max_tokens: int, error: type[Exception]
) -> None:
    engine = engine_for("llama")
    with pytest.raises(error):
        engine.submit(make_request("bad", prompt, max_tokens=max_tokens), Collector())
    assert not engine.scheduler.has_work()


def test_conflicting_scopes_are_refused_at_submission() -> None:
    engine = engine_for("llama")
    segments = [Segment(0, 10, User("t1", "alice"))]
    request = make_request("bad", tokens(8, 10), user="bob", segments=segments)
    with pytest.raises(InvalidRequest, match="conflicting"):
        engine.submit(request, Collector())


def _fields(request: GenerationRequest) -> dict[str, object]:
    return {name: getattr(request, name) for name in GenerationRequest.__slots__}


def test_a_long_prefill_leaves_room_for_a_short_request_that_arrives() -> None:
    engine = engine_for("llama", max_num_batched_tokens=1024, num_blocks=512)
    long, short = Collector(), Collector()
    engine.submit(make_request("long", [7] * 2040, max_tokens=1), long)
    engine.step()  # alone, the long prompt takes the whole budget: 1,024 of its tokens
    assert [sequence.num_computed for sequence in engine.scheduler.running] == [1024]
    engine.submit(make_request("short", [9] * 40, tenant="t2", max_tokens=1), short)
    engine.step()
    # Crowded, the long prompt takes at most 512 tokens, and the short one fits beside it
    # (without that cap it would get 8 tokens now and its answer a step later).
    assert short.done and not long.done
    while engine.step():
        pass
    assert long.done and long.error is None


def test_a_tenants_flood_of_long_prompts_leaves_another_tenant_its_share_of_each_step() -> None:
    engine = engine_for("llama", max_num_batched_tokens=1024, num_blocks=512)
    counter = PositionCounter(engine, [])
    counter.prompt_lens = {f"flood{i}": 2040 for i in range(4)} | {"short": 40}
    flood = [Collector() for _ in range(4)]
    for i, collector in enumerate(flood):
        request = make_request(f"flood{i}", [7 + i] * 2040, tenant="flood", max_tokens=1)
        engine.submit(request, collector)
    engine.step()  # the flood alone: two chunks of 512 fill the step, two prompts wait
    assert sorted(s.num_computed for s in engine.scheduler.running) == [512, 512]
    engine.step()  # all four are running now; the flood keeps the whole budget
    assert counter.batch_tokens == [1024, 1024]
    short = Collector()
    engine.submit(make_request("short", [9] * 40, tenant="t2", max_tokens=1), short)
    engine.step()
    # Two tenants with work: the short request's 40 tokens come out of t2's half of the step,
    # arrival order notwithstanding, and the flood gets the rest (1,024 - 40).
    assert short.done
    assert counter.batch_tokens[-1] == 1024
    while engine.step():
        pass
    assert all(collector.done and collector.error is None for collector in flood)


def test_leftover_budget_goes_to_the_prefills_a_share_cut_short() -> None:
    engine = engine_for("llama", max_num_batched_tokens=256, num_blocks=512)
    counter = PositionCounter(engine, [])
    counter.prompt_lens = {"long": 1000, "chat": 20}
    chat, long = Collector(), Collector()
    engine.submit(make_request("chat", [5] * 20, tenant="t1", max_tokens=50), chat)
    engine.step()  # the chat's prompt; it decodes from here on, one token a step
    engine.submit(make_request("long", [6] * 1000, tenant="t2", max_tokens=1), long)
    engine.step()
    engine.step()
    # t2's share is 128 tokens, but t1 uses only 1 of its own 128: t2 gets the other 127.
    assert counter.batch_tokens[1:] == [256, 256]
