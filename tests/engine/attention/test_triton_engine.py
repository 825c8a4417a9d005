"""The engine on the Triton backend (on the GPU, or in Triton's interpreter without one)
generates what it generates on the torch reference backend on the same device, cache hits
included, and zeroes freed blocks with the Triton kernel."""

from __future__ import annotations

import torch

from tests.engine.prompts import tokens
from tests.support.models import TRITON_DEVICE, engine_for, make_request, run_one


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
