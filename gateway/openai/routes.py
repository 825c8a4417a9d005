"""POST /v1/chat/completions and /v1/completions.

A request body is parsed and validated off the event loop, together with templating,
tokenization and planning, a bounded number at a time, and only after the tenant's
concurrency slot is taken: a 1 MB body of 20,000 messages costs its sender a slot and a
thread for a moment, never the event loop that answers everyone else.

A request's path: this route -> gateway/openai/preparation.py (template, plan, engine request) ->
gateway/openai/serving.py (engine, JSON or SSE) -> gateway/http/settlement.py (its one audit
event, written when the request gate settles it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from pydantic_core import from_json
from starlette.concurrency import run_in_threadpool

from gateway.errors import APIError, validation_to_api_error
from gateway.http.deps import SettlementDep, StateDep, UserHeaderDep
from gateway.http.openapi import INFERENCE_RESPONSES, json_body
from gateway.http.settlement import Settlement
from gateway.openai.preparation import (
    Prepared,
    RequestContext,
    prepare_chat,
    prepare_completion,
    with_grammar,
)
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.openai.serving import respond
from gateway.state import GatewayState

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["inference"], responses=INFERENCE_RESPONSES)
Body = TypeVar("Body", bound=SamplingFields)
Preparation = Callable[[GatewayState, Body, RequestContext], Prepared]


@router.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(
    request: Request, state: StateDep, settlement: SettlementDep, user: UserHeaderDep
) -> Response:
    return await _serve(state, request, settlement, user, ChatCompletionRequest, prepare_chat)


@router.post("/completions", openapi_extra=json_body(CompletionRequest))
async def completions(
    request: Request, state: StateDep, settlement: SettlementDep, user: UserHeaderDep
) -> Response:
    return await _serve(state, request, settlement, user, CompletionRequest, prepare_completion)


async def _serve(
    state: GatewayState,
    request: Request,
    settlement: Settlement,
    header_user: str | None,
    model: type[Body],
    prepare: Preparation[Body],
) -> Response:
    """Parse and prepare off the event loop (a bounded number at a time), then serve."""
    raw = await request.body()  # already read, within its limit, by BodySizeLimit
    validation_context = {"max_messages": state.settings.max_messages}

    def parse_and_prepare(context: RequestContext) -> Prepared:
        try:
            # Parse, then validate the Python objects: the message cap is checked before a
            # single message is (cheaper than validating straight from JSON on a large body).
            data = from_json(raw, allow_inf_nan=False)
        except ValueError:
            try:  # lone surrogates, NaN: Python's parser takes them, validation names the field
                data = json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
                raise APIError.not_json() from None
        if state.settings.drop_unknown_params and isinstance(data, dict):
            data = _known_fields(data, model)
        try:
            body = model.model_validate(data, context=validation_context)
        except ValidationError as error:
            raise validation_to_api_error(error.errors()) from None
        settlement.model = body.model  # for the audit event, served or not
        return prepare(state, body, context)

    with state.tracer.start_as_current_span(f"inference.{settlement.endpoint}") as span:
        context = RequestContext.of(settlement, header_user, span)
        span.set_attribute("prefixgate.tenant", context.caller.tenant_slug)
        # The slots are shared by all tenants; each piece of work behind them is capped by the
        # body, message and character limits, and a tenant has at most its concurrency limit of
        # requests queued here (the gate took the slot before the body was read).
        async with state.prepare_slots:
            prepared = await run_in_threadpool(parse_and_prepare, context)
        if prepared.grammar_wanted is not None:  # a costly schema holds its own tenant's turn
            async with state.compile_turns.turn(context.caller.tenant_id):
                prepared = await run_in_threadpool(with_grammar, state, prepared)
        span.set_attribute("prefixgate.prompt_tokens", len(prepared.request.prompt_token_ids))
        span.set_attribute("prefixgate.public_tokens", prepared.plan.public_tokens)
        return await respond(state, prepared, request)


_dropped: set[str] = set()  # field names already logged as dropped
_MAX_DROPPED_LOGGED = 100  # a client inventing names cannot fill the log


def _known_fields(data: dict[str, object], model: type[Body]) -> dict[str, object]:
    """`data` without the fields `model` does not know; each new name is logged once."""
    unknown = [name for name in data if name not in model.model_fields]
    for name in unknown:
        if name not in _dropped and len(_dropped) < _MAX_DROPPED_LOGGED:
            _dropped.add(name)
            logger.warning("dropping unknown request field %r (drop_unknown_params)", name[:64])
    return {name: value for name, value in data.items() if name in model.model_fields}
