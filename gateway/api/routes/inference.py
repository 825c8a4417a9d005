"""POST /v1/chat/completions and /v1/completions.

A request body is parsed and validated off the event loop, together with templating,
tokenization and planning, a bounded number at a time, and only after the tenant's
concurrency slot is taken: a 1 MB body of 20,000 messages costs its sender a slot and a
thread for a moment, never the event loop that answers everyone else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from opentelemetry.trace import Span
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.concurrency import run_in_threadpool

from gateway.api.deps import SettlementDep, StateDep, UserHeaderDep
from gateway.api.openapi import INFERENCE_RESPONSES, json_body
from gateway.errors import invalid, validation_to_api_error
from gateway.inference import Prepared, prepare_chat, prepare_completion
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.serving import respond
from gateway.settlement import Settlement
from gateway.state import GatewayState

router = APIRouter(prefix="/v1", tags=["inference"], responses=INFERENCE_RESPONSES)
Body = TypeVar("Body", bound=BaseModel)


@router.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(
    request: Request, state: StateDep, settlement: SettlementDep, user: UserHeaderDep = None
) -> Response:
    def prepare(body: ChatCompletionRequest, span: Span) -> Prepared:
        return prepare_chat(state, body, settlement, user, span)

    return await _serve(state, request, settlement, ChatCompletionRequest, prepare)


@router.post("/completions", openapi_extra=json_body(CompletionRequest))
async def completions(
    request: Request, state: StateDep, settlement: SettlementDep, user: UserHeaderDep = None
) -> Response:
    def prepare(body: CompletionRequest, span: Span) -> Prepared:
        return prepare_completion(state, body, settlement, user, span)

    return await _serve(state, request, settlement, CompletionRequest, prepare)


async def _serve(
    state: GatewayState,
    request: Request,
    settlement: Settlement,
    model: type[Body],
    prepare: Callable[[Body, Span], Prepared],
) -> Response:
    """Admit, parse and prepare off the event loop (a bounded number at a time), serve."""
    assert settlement.principal is not None  # the gate authenticated every /v1 request
    raw = await request.body()  # already read, within its limit, by BodySizeLimit
    context = {"max_messages": state.settings.max_messages}

    def parse_and_prepare(span: Span) -> Prepared:
        try:
            # Parse, then validate the Python objects: the message cap is checked before a
            # single message is (validating straight from JSON costs 7x as much at 1 MB).
            data = from_json(raw, allow_inf_nan=False)
        except ValueError:
            try:  # lone surrogates, NaN: Python's parser takes them, validation names the field
                data = json.loads(raw)
            except ValueError:
                raise invalid("the request body is not valid JSON") from None
        try:
            body = model.model_validate(data, context=context)
        except ValidationError as error:
            raise validation_to_api_error(error.errors()) from None
        return prepare(body, span)

    with state.tracer.start_as_current_span(f"inference.{settlement.endpoint}") as span:
        span.set_attribute("prefixgate.tenant", settlement.principal.tenant_slug)
        # The tenant's concurrency limit applies before any parsing or templating, so one
        # tenant's requests never hold more of that work than its own share.
        settlement.admission = state.limiter.enter(settlement.principal)
        async with state.prepare_slots:
            prepared = await run_in_threadpool(parse_and_prepare, span)
        span.set_attribute("prefixgate.prompt_tokens", len(prepared.request.prompt_token_ids))
        span.set_attribute("prefixgate.public_tokens", prepared.plan.public_tokens)
        return await respond(state, prepared, request)
