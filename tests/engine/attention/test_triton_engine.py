"""The engine on the Triton backend (on the GPU, or in Triton's interpreter without one)
generates what it generates on the torch reference backend on the same device, cache hits
included, and zeroes freed blocks with the Triton kernel; a request's tokens and logprobs are
the same bits alone and beside others (batch invariance)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from engine.sampling.sampler import SamplingParams, TokenLogprobs
from tests.engine.prompts import tokens
from tests.support.models import TRITON_DEVICE, Collector, engine_for, make_request, run_one


def test_greedy_output_with_triton_equals_torch_including_a_cached_prefix() -> None:
    prefix = tokens(0, 37)  # two full blocks of 16 and five tokens into the third
    outputs = {}
    for backend in ("torch", "triton"):
        engine = engine_for("llama", device=TRITON_DEVICE, attention_backend=backend)
        assert engine.describe()["attention_backend"] == backend
        warm = run_one(engine, make_request("warm", prefix + tokens(1, 9), max_tokens=5))
        hit = run_one(engine, make_request("hit", prefix + tokens(2, 11), max_tokens=6))
        assert hit.usage.cached_tokens == 32
        outputs[backend] = (warm.token_ids, hit.token_ids)
    assert outputs["triton"] == outputs["torch"]


def test_freed_blocks_are_zeroed_by_the_triton_kernel() -> None:
    engine = engine_for(
        "llama", device=TRITON_DEVICE, attention_backend="triton", enable_prefix_caching=False
    )
    pool = engine.pool
    assert pool.zero_blocks == engine.runner.backend.zero_blocks
    run_one(engine, make_request("a", tokens(3, 40), max_tokens=3))
    # Without caching every block the request used went back to be zeroed at its step's end.
    assert pool.blocks_zeroed >= 3 and pool.num_available == pool.num_blocks
    assert torch.count_nonzero(pool.kv) == 0
    pool.check_consistency()


@cache
def target_decode(others: int) -> tuple[list[int], list[TokenLogprobs]]:
    """A 260-token prompt's greedy tokens and their logprobs (top 5 of each step), alone or
    beside `others` requests. The short ones (`others` - 1) arrive with it and prefill in its
    step; the long one arrives after that step and extends the target's cached 256 tokens to
    520 (so that its prefill shares the target's first decode step, and its 3 decode splits
    widen the grid beyond the target's 2 in the next ones)."""
    engine = engine_for("llama", device=TRITON_DEVICE, attention_backend="triton")
    sampling = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
    prompt = tokens(40, 260)
    collectors = [Collector()]
    engine.submit(make_request("target", prompt, sampling=sampling), collectors[0])
    for i in range(1, others):
        collectors.append(Collector())
        short = make_request(f"short-{i}", tokens(50 + i, 5 * i), max_tokens=i)
        engine.submit(short, collectors[-1])
    engine.step()
    if others:
        collectors.append(Collector())
        long = make_request("long", prompt[:256] + tokens(49, 264), max_tokens=3)
        engine.submit(long, collectors[-1])
    while engine.step():
        pass
    assert all(collector.done for collector in collectors)
    if others:
        assert collectors[-1].usage.cached_tokens == 256
    logprobs = [entry for delta in collectors[0].deltas for entry in delta.logprobs or []]
    return collectors[0].token_ids, logprobs


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="torch's own GPU products are not batch-invariant"
)
@pytest.mark.parametrize("others", [1, 7])
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_batch_on_cpu(others: int) -> None:
    engine = engine_for("llama", device=TRITON_DEVICE, attention_backend="triton")
    if engine.describe()["linear_kernel"] != "matrix":
        pytest.skip("fp32 projections on this CPU run on torch's paths, not batch-invariant")
    tokens_alone, logprobs_alone = target_decode(0)
    assert len(tokens_alone) == len(logprobs_alone) == 4
    assert target_decode(others) == (tokens_alone, logprobs_alone)
