"""I1: greedy output with the prefix cache equals output without it, token for token."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from tests.engine.prompts import shared_prefix_requests, tokens
from tests.support.models import ARCHITECTURES, engine_for, make_request, run_all, run_one


def pair(architecture: str, **config: object) -> tuple[Engine, Engine]:
    """The same model twice: prefix caching on and off."""
    cached = engine_for(architecture, **config)
    uncached = engine_for(architecture, enable_prefix_caching=False, **config)
    return cached, uncached


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_prefix_ending_mid_block_reuses_its_whole_blocks_with_identical_output(
    architecture: str,
) -> None:
    cached, uncached = pair(architecture)
    prefix = tokens(0, 37)  # two full blocks of 16 and five tokens into the third
    first = make_request("warm", prefix + tokens(1, 9), max_tokens=4)
    second = make_request("hit", prefix + tokens(2, 11), max_tokens=12)
    run_one(cached, first)
    hit = run_one(cached, second)
    assert hit.usage.cached_tokens == 32
    assert hit.token_ids == run_one(uncached, second).token_ids


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_second_turn_reuses_the_first_turn_and_its_answer_with_identical_output(
    architecture: str,
) -> None:
    cached, uncached = pair(architecture)
    turn_one = tokens(3, 40)
    answer = run_one(cached, make_request("turn-1", turn_one, max_tokens=20)).token_ids
    turn_two = turn_one + answer + tokens(4, 13)
    second = run_one(cached, make_request("turn-2", turn_two, max_tokens=12))
    # Turn 2 reuses the prompt *and* the generated answer of turn 1 (whole blocks of them).
    assert second.usage.cached_tokens == (len(turn_one) + len(answer)) // 16 * 16
    assert second.usage.cached_tokens > len(turn_one)
    alone = run_one(uncached, make_request("t2", turn_two, max_tokens=12))
    assert second.token_ids == alone.token_ids


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_shared_prefix_under_eviction_and_preemption_gives_identical_output(
    architecture: str,
) -> None:
    config = {"num_blocks": 36, "max_num_batched_tokens": 96}
    cached, uncached = pair(architecture, **config)
    tenants = ["tenant-0", "tenant-1", "tenant-2"]
    requests = shared_prefix_requests(tokens(5, 50), "default", tenants, 12, 10, "shared-")
    # Long unrelated prompts that do not fit next to everything else: evictions, preemption.
    requests += [make_request(f"long-{i}", tokens(40 + i, 130), tenant="big", max_tokens=6)
                 for i in range(4)]  # fmt: skip
    with_cache = run_all(cached, requests)
    stats = cached.cache_stats()
    assert stats.evicted_blocks > 0 and cached.metrics.preemptions > 0
    # Requests admitted in the same step as the first cannot hit yet; most later ones do.
    assert sum(c.usage.cached_tokens >= 48 for c in with_cache[:12]) >= 6
    without_cache = [run_one(uncached, request) for request in requests]
    for got, expected in zip(with_cache, without_cache, strict=True):
        assert got.token_ids == expected.token_ids


def test_greedy_output_matches_transformers_generate() -> None:
    from tests.support.models import reference_copy, tiny_model

    engine = engine_for("llama")
    prompt = tokens(7, 45)
    ours = run_one(engine, make_request("r", prompt, max_tokens=16)).token_ids
    reference = reference_copy(tiny_model("llama"))
    with torch.inference_mode():
        theirs = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    assert ours == theirs
