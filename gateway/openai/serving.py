"""Running a prepared request: limits, the engine stream, JSON or SSE, disconnects, timeouts.

The first delta is awaited before any response starts, so failures that happen before the
first token (quota timeouts, overload) still get their proper HTTP status. After that, a
streamed error is an `{"error": ...}` event. A client that goes away cancels the engine
request, which frees its KV blocks at the next engine step.

`request_timeout_s` bounds the whole request, counted from its arrival at the gate: one
deadline serves the wait for the first token and every token after it, so a stream that keeps
producing tokens still ends at the deadline (a 504 before the response starts, an error event
`timeout` after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from engine.request import GenerationDelta, Usage
from gateway.errors import APIError, engine_failure
from gateway.http.settlement import CLIENT_CLOSED
from gateway.observability.tracing import record_engine_phases
from gateway.openai.choices import Choices, completion_body
from gateway.openai.preparation import Prepared
from gateway.openai.responses import (
    chat_chunk,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    text_choice,
    text_completion,
)
from gateway.openai.tool_calls import IndexedToolCall, ToolCallStream
from gateway.state import GatewayState

_DISCONNECT_POLL_S = 0.05
T = TypeVar("T")


class _ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def respond(state: GatewayState, prepared: Prepared, http_request: Request) -> Response:
    """Charge the request's tokens, run it, and answer with JSON or a stream of events."""
    request = prepared.request
    cost = len(request.prompt_token_ids) + request.n * request.sampling.max_tokens
    admission = prepared.context.settlement.admission
    assert admission is not None  # the gate entered the limiter before the body was read
    try:
        await admission.charge(cost, request.n)
    except APIError as error:
        _conclude(state, prepared, "rejected", error=error)
        raise
    deadline = _deadline(state, prepared)
    stream = prepared.model.engine.generate(prepared.request)
    try:
        first = await _first_delta(prepared, stream, http_request, deadline)
    except APIError as error:
        _conclude(state, prepared, "failure" if error.status >= 500 else "rejected", error=error)
        raise
    except _ClientGone:  # nobody reads the answer: no error, no traceback
        _conclude(state, prepared, "cancelled")
        return Response(status_code=CLIENT_CLOSED)
    except asyncio.CancelledError:
        _conclude(state, prepared, "cancelled")
        raise
    if prepared.stream:
        # On shutdown, let in-flight streams finish (within uvicorn's graceful timeout).
        grace = max(0.0, state.settings.shutdown_grace_s - 1)
        return _StreamResponse(
            _events(state, prepared, first, stream, deadline),
            cleanup=lambda: _abandon(state, prepared, stream),
            ping=15,
            sep="\n",
            shutdown_grace_period=grace,
        )
    return await _complete(state, prepared, first, stream, http_request, deadline)


def _deadline(state: GatewayState, prepared: Prepared) -> float:
    """The event loop's time at which the request's `request_timeout_s` runs out, counted from
    when the gate opened its settlement (its parsing and preparation count too)."""
    elapsed = time.perf_counter() - prepared.context.settlement.started
    return asyncio.get_running_loop().time() + state.settings.request_timeout_s - elapsed


async def _first_delta(
    prepared: Prepared,
    stream: AsyncIterator[GenerationDelta],
    http_request: Request,
    deadline: float,
) -> GenerationDelta:
    try:
        return await _unless_disconnected(anext(stream), stream, http_request, deadline)
    except StopAsyncIteration as error:  # pragma: no cover - the engine always ends with usage
        raise APIError.internal("the engine produced no output") from error
    except (APIError, _ClientGone):
        raise
    except Exception as error:
        raise _engine_failure(error, prepared) from error


async def _unless_disconnected(
    work: Awaitable[T],
    stream: AsyncIterator[GenerationDelta],
    http_request: Request,
    deadline: float,
) -> T:
    """Await `work`, giving up (and cancelling the request) if the client leaves or the
    request's deadline passes. One task for the whole wait, not one per token."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                raise _ClientGone
            if asyncio.get_running_loop().time() > deadline:
                raise APIError.timeout()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await _close(stream)


class _StreamResponse(EventSourceResponse):
    """An SSE response that always settles its request, even if its body never started
    (a client that left between the first token and the first byte)."""

    def __init__(self, content: Any, cleanup: Callable[[], Awaitable[None]], **options: Any):
        super().__init__(content, **options)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def _abandon(
    state: GatewayState, prepared: Prepared, stream: AsyncIterator[GenerationDelta]
) -> None:
    if prepared.context.settlement.outcome is None:
        await _close(stream)
        _conclude(state, prepared, "cancelled")


async def _close(stream: AsyncIterator[GenerationDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(BaseException):
            await aclose()


async def _complete(
    state: GatewayState,
    prepared: Prepared,
    first: GenerationDelta,
    stream: AsyncIterator[GenerationDelta],
    http_request: Request,
    deadline: float,
) -> Response:
    choices = Choices(prepared.request.n)
    choices.add(first)

    async def rest() -> None:
        while not choices.done:
            choices.add(await anext(stream))

    try:
        await _unless_disconnected(rest(), stream, http_request, deadline)
    except _ClientGone:
        _conclude(state, prepared, "cancelled")
        return Response(status_code=CLIENT_CLOSED)
    except asyncio.CancelledError:
        _conclude(state, prepared, "cancelled")
        raise
    except APIError as error:
        _conclude(state, prepared, "failure", error=error)
        raise
    except Exception as error:
        api_error = _engine_failure(error, prepared)
        _conclude(state, prepared, "failure", error=api_error)
        raise api_error from error
    usage = choices.usage(len(prepared.request.prompt_token_ids))
    _conclude(state, prepared, "success", usage, last=choices.last)
    headers = _server_timing(http_request, choices.last)
    model = prepared.model
    build = partial(completion_body, model.loaded.tokenizer, model.name, prepared, choices)

    def render() -> JSONResponse:
        return JSONResponse(build(usage), headers=headers)

    # Logprobs name up to 21 tokens per token: such a body is built and encoded off the loop.
    wants_logprobs = prepared.request.sampling.logprobs is not None
    return await asyncio.to_thread(render) if wants_logprobs else render()


def _server_timing(http_request: Request, last: GenerationDelta | None) -> dict[str, str]:
    """`Server-Timing`: time in the engine, and what the HTTP path added on top."""
    arrived = getattr(http_request.state, "arrived", None)
    if arrived is None or last is None or last.timings is None:
        return {}
    total_ms = (time.perf_counter() - arrived) * 1000
    engine_ms = (last.timings.finished - last.timings.arrived) * 1000
    gateway_ms = max(0.0, total_ms - engine_ms)
    return {"Server-Timing": f"engine;dur={engine_ms:.3f}, gateway;dur={gateway_ms:.3f}"}


async def _events(
    state: GatewayState,
    prepared: Prepared,
    first: GenerationDelta,
    stream: AsyncIterator[GenerationDelta],
    deadline: float,
) -> AsyncIterator[dict[str, Any]]:
    model, response_id, created = prepared.model.name, prepared.response_id, prepared.created
    chat = prepared.context.endpoint == "chat"
    tokenizer = prepared.model.loaded.tokenizer
    wants_logprobs = prepared.request.sampling.logprobs is not None
    n = prepared.request.n
    # Per choice: where its next token's text starts, for completions' text_offset.
    text_offsets = [0] * n
    # Per choice, for a completion that echoes its prompt: whether the prompt has been sent.
    echoed = [prepared.echo is None] * n
    # Per choice, for a chat that gave the model tools: its answer read for calls, and
    # whether it made one.
    readers = [ToolCallStream() for _ in range(n)] if prepared.tool_calls else None
    called = [False] * n

    def chat_piece(delta: GenerationDelta) -> dict[str, Any] | None:
        text, finish_reason, logprobs, index = delta.text, delta.finish_reason, None, delta.index
        if wants_logprobs and delta.logprobs:
            logprobs = chat_logprobs(tokenizer, delta.logprobs)
        if readers is None:
            plain = {"content": text} if text or not finish_reason or logprobs else {}
            return chat_chunk(
                response_id, created, model, plain, finish_reason, None, logprobs, index
            )
        events = readers[index].feed(text)
        if finish_reason is not None:
            events += readers[index].finish()
        calls = [event.delta() for event in events if isinstance(event, IndexedToolCall)]
        called[index] = called[index] or bool(calls)
        if called[index] and finish_reason == "stop":
            finish_reason = "tool_calls"
        content: dict[str, Any] = {}
        if text := "".join(event for event in events if isinstance(event, str)):
            content["content"] = text
        if calls:
            content["tool_calls"] = calls
        if not content and finish_reason is None and logprobs is None:
            return None  # held back: it may be the start of a call
        return chat_chunk(
            response_id, created, model, content, finish_reason, None, logprobs, index
        )

    def piece(delta: GenerationDelta) -> dict[str, Any] | None:
        text, finish_reason, logprobs, index = delta.text, delta.finish_reason, None, delta.index
        if chat:
            return chat_piece(delta)
        prompt = ""
        if not echoed[index]:  # the choice's first piece starts with the prompt
            echoed[index], prompt = True, prepared.echo or ""
        if wants_logprobs:
            start = text_offsets[index] + len(prompt)
            offsets = [start] * len(delta.logprobs or [])
            output = completion_logprobs(tokenizer, delta.logprobs or [], offsets)
            logprobs = output
            if prompt:
                prompt_ids, scored = prepared.request.prompt_token_ids, delta.prompt_logprobs
                logprobs = echoed_logprobs(tokenizer, prompt_ids, scored or [], output)
        text_offsets[index] += len(prompt) + len(text)
        choice = text_choice(index, prompt + text, finish_reason, logprobs)
        return text_completion(response_id, created, model, [choice], None)

    def event(payload: dict[str, Any]) -> dict[str, Any]:
        return {"data": json.dumps(payload, ensure_ascii=False)}

    def rendered(delta: GenerationDelta) -> dict[str, Any] | None:
        payload = piece(delta)
        return None if payload is None else event(payload)

    outcome, failure = "cancelled", None
    choices = Choices(n)
    try:
        if chat:
            for index in range(n):
                role = {"role": "assistant", "content": ""}
                yield event(chat_chunk(response_id, created, model, role, index=index))
        delta = first
        while True:
            choices.add(delta)
            if (
                delta.text
                or delta.finish_reason
                or (wants_logprobs and delta.logprobs)
                or not echoed[delta.index]
            ):
                # A choice's first delta may carry its prompt's logprobs: rendered off the loop.
                item = (
                    await asyncio.to_thread(rendered, delta)
                    if delta.prompt_logprobs
                    else rendered(delta)
                )
                if item is not None:
                    yield item
            if choices.done:
                break
            # Checked before each wait too: a delta already queued is taken without a pause,
            # where the timeout below could not interrupt it.
            if asyncio.get_running_loop().time() >= deadline:
                raise APIError.timeout()
            try:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(stream)
            except TimeoutError as error:
                raise APIError.timeout() from error
        usage = choices.usage(len(prepared.request.prompt_token_ids))
        if prepared.include_usage:
            usage_chunk = (
                chat_chunk(response_id, created, model, None, usage=usage)
                if chat
                else text_completion(response_id, created, model, [], usage)
            )
            yield event(usage_chunk)
        yield {"data": "[DONE]"}
        outcome = "success"
        _conclude(state, prepared, outcome, usage, last=choices.last)
    except APIError as error:
        outcome, failure = "failure", error
        yield event(error.body())
    except Exception as error:
        outcome, failure = "failure", _engine_failure(error, prepared)
        yield event(failure.body())
    finally:
        await _close(stream)
        if outcome != "success":
            _conclude(state, prepared, outcome, error=failure)


def _conclude(
    state: GatewayState,
    prepared: Prepared,
    outcome: str,
    usage: Usage | None = None,
    error: APIError | None = None,
    last: GenerationDelta | None = None,
) -> None:
    """Note how the request ended (the first conclusion wins); it is settled by the gate."""
    settlement = prepared.context.settlement
    if settlement.outcome is not None:
        return
    timings = last.timings if last is not None else None
    settlement.conclude(outcome, usage, error, timings)
    if timings is not None:
        record_engine_phases(state.tracer, prepared.context.span, timings)


def _engine_failure(error: Exception, prepared: Prepared) -> APIError:
    context = prepared.context
    return engine_failure(error, context.caller.tenant_slug, context.prompt_param)
