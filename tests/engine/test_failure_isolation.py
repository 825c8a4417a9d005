"""I8: a request that fails inside a step fails alone; everyone else gets exactly their tokens.

Faults are injected into one request of a batch of several tenants' greedy requests on a tiny
seeded model, through hooks on the model's embedding that fire only for a sentinel token that
only the faulty request contains: its hidden states turn NaN, or the forward pass raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.engine import Engine
from engine.errors import RequestFailed
from engine.request import GenerationDelta, GenerationRequest
from tests.engine.prompts import tokens as random_tokens
from tests.support.models import VOCAB, Collector, engine_for, make_request, run_all, run_one

SENTINEL = VOCAB - 1


def tokens(seed: int, count: int) -> list[int]:
    """Random prompt tokens that never include the sentinel."""
    return random_tokens(seed, count, vocab=SENTINEL)


def healthy_requests() -> list[GenerationRequest]:
    lengths = [30, 45, 12, 60]
    return [
        make_request(f"ok-{index}", tokens(index, length), tenant=f"t{index}", max_tokens=12)
        for index, length in enumerate(lengths)
    ]


def faulty_request() -> GenerationRequest:
    prompt = tokens(99, 50)
    prompt[40] = SENTINEL  # late in the prompt: earlier chunks of it compute fine
    return make_request("faulty", prompt, tenant="t-bad", max_tokens=12)


def alone(request: GenerationRequest) -> list[int]:
    """The request's tokens in a clean engine of its own."""
    output = run_one(engine_for("llama"), request).token_ids
    assert SENTINEL not in output  # else the fault would hit this request too
    return output


@contextmanager
def nan_at_sentinel(engine: Engine) -> Iterator[None]:
    """The embedding of the sentinel becomes NaN: its request's KV and logits follow."""

    def hook(
        _: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor:
        return output.masked_fill((args[0] == SENTINEL).unsqueeze(-1), float("nan"))

    handle = engine.runner.model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def raise_at_sentinel(engine: Engine) -> Iterator[None]:
    """Any forward pass whose input holds the sentinel raises."""

    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if bool((args[0] == SENTINEL).any()):
            raise RuntimeError("injected fault: the sentinel token is in this batch")

    handle = engine.runner.model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


FAULTS = {"nan_logits": nan_at_sentinel, "forward_raises": raise_at_sentinel}


@pytest.mark.parametrize("batched_tokens", [2048, 24], ids=["one_step_prefill", "chunked"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_faulty_request_fails_alone_and_the_others_match_their_solo_runs(
    fault: str, batched_tokens: int
) -> None:
    healthy = healthy_requests()
    expected = [alone(request) for request in healthy]
    engine = engine_for("llama", max_num_batched_tokens=batched_tokens)
    batch = [*healthy[:2], faulty_request(), *healthy[2:]]
    with FAULTS[fault](engine):
        results = run_all(engine, batch)
        broken = results.pop(2)
        assert isinstance(broken.error, RequestFailed)
        assert [result.error for result in results] == [None] * len(healthy)
        assert [result.token_ids for result in results] == expected
        # The engine keeps serving, faulty inputs included: each fails on its own again.
        again = run_all(engine, [faulty_request(), healthy[0]])
        assert isinstance(again[0].error, RequestFailed)
        assert again[1].token_ids == expected[0]
    assert bool(torch.isfinite(engine.pool.kv).all())  # nothing it computed lingers
    # Nothing the faulty request computed stayed cached: without the fault it runs normally.
    assert run_one(engine, faulty_request()).token_ids == alone(faulty_request())
    engine.pool.check_consistency()


class RaisingSink(Collector):
    """A client whose delivery breaks on its third delta."""

    def __call__(self, item: GenerationDelta | Exception) -> None:
        if isinstance(item, GenerationDelta) and len(self.deltas) == 2:
            raise ConnectionError("the client's stream broke")
        super().__call__(item)


def test_a_sink_that_raises_fails_only_its_own_request() -> None:
    healthy = healthy_requests()
    expected = [alone(request) for request in healthy]
    engine = engine_for("llama")
    broken = RaisingSink()
    engine.submit(make_request("broken", tokens(50, 20), tenant="t-bad", max_tokens=12), broken)
    results = run_all(engine, healthy)
    assert isinstance(broken.error, RequestFailed)
    assert [result.token_ids for result in results] == expected
    assert engine.pool.num_active == 0
