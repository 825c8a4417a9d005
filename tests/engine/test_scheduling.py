"""Scheduler and engine loop: chunked prefill, preemption, quotas, cancellation, I6."""

from __future__ import annotations

import pytest
import torch

from engine.budget import TenantBudget
from engine.engine import Engine
from engine.errors import CacheQuotaTimeout, ContextTooLong, InvalidRequest
from engine.model_runner import Chunk
from engine.request import GenerationRequest
from engine.scope import Public, Segment, User
from tests.support.models import VOCAB, Collector, engine_for, make_request, run_all, run_one


def tokens(seed: int, count: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count,), generator=generator).tolist()


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
    system = tokens(1, 70)
    requests = []
    for index in range(8):
        tenant = f"t{index % 2}"
        segments = [Segment(0, 70, Public("ns")), Segment(70, 90, User(tenant, "u"))]
        requests.append(
            make_request(f"r{index}", system + tokens(10 + index, 20), tenant=tenant, user="u",
                         max_tokens=12, segments=segments)
        )  # fmt: skip
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


def test_request_that_never_fits_its_quota_fails_typed_after_the_timeout() -> None:
    engine = engine_for("llama", queue_timeout_s=5.0)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    request = GenerationRequest(
        **{**_fields(make_request("big", tokens(5, 100))), "budget": TenantBudget(4)}
    )
    collector = Collector()
    engine.submit(request, collector)
    engine.step()
    assert collector.error is None  # waiting, not failed
    now[0] = 6.0
    engine.step()
    assert isinstance(collector.error, CacheQuotaTimeout)
    assert "cache quota exceeded for tenant 't1'" in str(collector.error)


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
    from engine.sampler import SamplingParams

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
