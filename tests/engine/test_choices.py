"""n > 1: the choices of one request share its prompt's KV, computed once.

Each choice must generate exactly what a request of its own would (fp32, same seed stream), so
sharing full blocks and copying a partly filled last block change nothing but the cost.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.cache.scope import NO_CACHE
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.request import GenerationDelta, GenerationRequest
from engine.sampling.sampler import SamplingParams
from engine.sequence import choice_request
from tests.support.models import engine_for, make_request, run_one

BLOCK = 16


class Choices:
    """A sink that sorts what the engine streams by choice."""

    def __init__(self, n: int) -> None:
        self.deltas: dict[int, list[GenerationDelta]] = {index: [] for index in range(n)}
        self.errors: list[Exception] = []

    def __call__(self, item: GenerationDelta | Exception) -> None:
        if isinstance(item, Exception):
            self.errors.append(item)
        else:
            self.deltas[item.index].append(item)

    def tokens(self, index: int) -> list[int]:
        return [token for delta in self.deltas[index] for token in delta.token_ids]

    def finished(self) -> bool:
        ends = [deltas[-1].finish_reason for deltas in self.deltas.values() if deltas]
        return len(ends) == len(self.deltas) and all(ends)


def run_choices(engine: Engine, request: GenerationRequest) -> Choices:
    sink = Choices(request.n)
    engine.submit(request, sink)
    for _ in range(10_000):
        if not engine.step():
            break
    return sink


def alone(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of `request` as a request of its own."""
    choice = choice_request(request, index)
    return dataclasses.replace(choice, n=1, request_id=f"alone-{index}")


def sampled(n: int, max_tokens: int = 12, seed: int = 7) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


def prompt(length: int) -> list[int]:
    return [(7 * position + 3) % 500 + 1 for position in range(length)]


@pytest.mark.parametrize("length", [5 * BLOCK + 7, 4 * BLOCK], ids=["partial-block", "full"])
def test_each_choice_generates_what_a_request_of_its_own_would(length: int) -> None:
    engine = engine_for("llama", enable_prefix_caching=False)
    request = dataclasses.replace(
        make_request("r", prompt(length), sampling=sampled(4)), n=4, tail_scope=NO_CACHE
    )
    sink = run_choices(engine, request)
    assert not sink.errors and sink.finished()
    single = engine_for("llama", enable_prefix_caching=False)
    for index in range(4):
        expected = run_one(single, alone(request, index)).token_ids
        assert sink.tokens(index) == expected, f"choice {index}"
    # Seeds differ per choice, so the choices are not copies of each other.
    assert len({tuple(sink.tokens(index)) for index in range(4)}) > 1


def test_the_prompt_is_computed_once_and_its_blocks_held_once() -> None:
    length, n, max_tokens = 5 * BLOCK + 7, 8, 10
    engine = engine_for("llama", enable_prefix_caching=False)
    request = dataclasses.replace(
        make_request("r", prompt(length), sampling=sampled(n, max_tokens)), n=n
    )
    sink = run_choices(engine, request)
    assert sink.finished()
    usages = [sink.deltas[index][-1].usage for index in range(n)]
    assert usages[0] is not None and usages[0].prompt_tokens == length
    assert all(usage is not None and usage.prompt_tokens == 0 for usage in usages[1:])
    assert engine.metrics.prompt_tokens == length
    # 5 full prompt blocks shared; each choice has its own copy of the partial block, and
    # 10 more tokens from position 87 end in that same block or the next one.
    shared, own_per_choice = 5, 2
    assert engine.cache.peak_active_blocks <= shared + n * own_per_choice
    # The same n generations as separate requests: n prompts computed, n prompts held.
    separate = engine_for("llama", enable_prefix_caching=False)
    for index in range(n):
        separate.submit(alone(request, index), Choices(1))
    while separate.step():
        pass
    assert separate.metrics.prompt_tokens == n * length
    assert separate.cache.peak_active_blocks >= n * (shared + 1)
    engine.pool.check_consistency()
    assert engine.pool.num_active == 0


def test_greedy_choices_are_identical() -> None:
    engine = engine_for("qwen2")
    request = dataclasses.replace(make_request("r", prompt(40), max_tokens=8), n=3)
    sink = run_choices(engine, request)
    assert sink.tokens(0) == sink.tokens(1) == sink.tokens(2)
    assert len(sink.tokens(0)) == 8


def test_a_choice_that_cannot_fork_computes_its_prompt_itself() -> None:
    # Two sequences at most: the third choice waits as a request of its own.
    engine = engine_for("llama", max_num_seqs=2, enable_prefix_caching=False)
    request = dataclasses.replace(
        make_request("r", prompt(3 * BLOCK + 1), sampling=sampled(3)), n=3
    )
    sink = run_choices(engine, request)
    assert sink.finished() and not sink.errors
    single = engine_for("llama", enable_prefix_caching=False)
    assert sink.tokens(2) == run_one(single, alone(request, 2)).token_ids
    assert engine.metrics.prompt_tokens == 3 * BLOCK + 1  # still counted once
    assert engine.pool.num_active == 0


def test_cancelling_a_request_ends_every_choice_and_frees_their_blocks() -> None:
    engine = engine_for("llama")
    request = dataclasses.replace(
        make_request("r", prompt(2 * BLOCK + 3), sampling=sampled(4, max_tokens=200)), n=4
    )
    sink = Choices(4)
    engine.submit(request, sink)
    for _ in range(3):
        engine.step()
    assert all(sink.deltas[index] for index in range(4)), "every choice has started"
    engine.cancel("r")
    while engine.step():
        pass
    assert engine.pool.num_active == 0
    assert not engine._requests
    engine.pool.check_consistency()


def test_cancelling_before_the_prompt_is_computed_ends_the_waiting_choices_too() -> None:
    engine = engine_for("llama", max_num_batched_tokens=16)
    request = dataclasses.replace(make_request("r", prompt(5 * BLOCK), max_tokens=4), n=3)
    sink = Choices(3)
    engine.submit(request, sink)
    engine.step()  # the first of five prefill chunks
    engine.cancel("r")
    while engine.step():
        pass
    assert not any(sink.deltas.values()) and not engine._requests
    assert engine.pool.num_active == 0


def test_n_out_of_range_is_refused_at_submission() -> None:
    engine = engine_for("llama")
    for n in (0, 129):
        request = dataclasses.replace(make_request("r", prompt(4)), n=n)
        with pytest.raises(InvalidRequest) as error:
            engine.submit(request, Choices(1))
        assert error.value.param == "n"
