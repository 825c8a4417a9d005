"""`Engine.generate` as an async iterator, with the engine loop in its own thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.errors import InvalidRequest
from tests.support.models import engine_for, make_request, run_one


def test_async_generate_streams_to_usage_and_matches_stepping() -> None:
    engine = engine_for("qwen2").start()

    async def collect() -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(make_request("a", list(range(40)), max_tokens=9)):
            tokens += delta.token_ids
            if delta.usage is not None:
                assert delta.finish_reason == "length"
                assert (delta.usage.prompt_tokens, delta.usage.completion_tokens) == (40, 9)
        return tokens

    try:
        streamed = asyncio.run(collect())
    finally:
        engine.stop()
    stepped = run_one(engine_for("qwen2"), make_request("b", list(range(40)), max_tokens=9))
    assert streamed == stepped.token_ids


def test_closing_the_stream_early_cancels_and_frees_blocks() -> None:
    engine = engine_for("llama").start()

    async def read_two_then_leave() -> None:
        stream = engine.generate(make_request("c", list(range(50)), max_tokens=500))
        async for _ in stream:
            if engine.metrics.steps >= 2:
                break
        await stream.aclose()

    try:
        asyncio.run(read_two_then_leave())
        deadline = time.monotonic() + 10
        while engine.pool.num_active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.pool.num_active == 0
        assert engine.metrics.cancelled == 1
    finally:
        engine.stop()


def test_invalid_request_raises_before_anything_streams() -> None:
    engine = engine_for("llama")

    async def consume() -> None:
        async for _ in engine.generate(make_request("d", [], max_tokens=5)):
            raise AssertionError("nothing may stream")

    with pytest.raises(InvalidRequest) as raised:
        asyncio.run(consume())
    engine.stop()
    assert raised.value.param == "prompt"
