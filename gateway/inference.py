"""From an OpenAI request to engine work: template, policy plan, sampling.

size caps -> chat template -> token ids + message spans -> policy plan (scopes) -> engine
request carrying the tenant's budget. Everything here runs off the event loop (see
routes/inference.py), and its cost is linear in the request's size, which is capped before
the template runs. How a request ended goes to its `Settlement`, which writes the audit event.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from engine.budget import TenantBudget
from engine.errors import EngineError, ExceedsCacheQuota
from engine.request import GenerationDelta, GenerationRequest, Usage
from engine.sampler import InvalidSampling, SamplingParams
from engine.scope import Public, Tenant, User
from gateway.auth import Principal
from gateway.errors import APIError, from_engine_error, invalid
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.settlement import Settlement
from gateway.state import GatewayState
from gateway.tracing import record_engine_phases
from policies.planner import MessageSpan, Plan, TenantPolicy
from policies.planner import Principal as PolicyPrincipal
from policies.templates import TemplateRejected, render_with_spans

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint


@dataclass
class Prepared:
    """A validated, planned request, ready for the engine."""

    endpoint: str
    request: GenerationRequest
    plan: Plan
    settlement: Settlement
    stream: bool
    include_usage: bool
    span: Span
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_param(self) -> str:
        """The request field that holds the prompt."""
        return prompt_param(self.endpoint)

    @property
    def principal(self) -> Principal:
        assert self.settlement.principal is not None  # the gate authenticated every request
        return self.settlement.principal


def prompt_param(endpoint: str) -> str:
    return "messages" if endpoint == "chat" else "prompt"


def user_scope_id(body_user: str | None, header_user: str | None, principal: Principal) -> str:
    """The end user inside the tenant, for private cache scopes.

    A header set by a proxy wins over the body's `user`; either is the client's own name, kept
    in a namespace of its own (`user:`), so no client can claim an API key's default scope
    (`key:<key id>`), which is what a request without a user gets.
    """
    named = header_user or body_user
    return f"user:{named}" if named else f"key:{principal.key_id}"


def user_hash(state: GatewayState, tenant_id: str, user: str) -> str:
    """The end user in audit events: a keyed hash, so a dictionary cannot reverse it."""
    message = f"audit-user\0{tenant_id}\0{user}".encode()
    return hmac.new(state.store.key_secret.encode(), message, hashlib.sha256).hexdigest()[:32]


def prepare_chat(
    state: GatewayState,
    body: ChatCompletionRequest,
    settlement: Settlement,
    header_user: str | None,
    span: Span,
) -> Prepared:
    check_common(state, body)
    _check_chars(state, body.text_chars(), "messages")
    tokenizer = state.loaded.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise invalid(f"model {state.model_name} has no chat template; use /v1/completions")
    messages = [{"role": _template_role(m.role), "content": m.text()} for m in body.messages]
    try:
        token_ids, spans = render_with_spans(tokenizer, messages)
    except TemplateRejected as error:  # role order, special tokens it cannot keep as text
        raise invalid(f"the chat template rejected these messages: {error}", "messages") from error
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _prepare(
        state, "chat", body, token_ids, spans, max_tokens, settlement, header_user, span
    )


def prepare_completion(
    state: GatewayState,
    body: CompletionRequest,
    settlement: Settlement,
    header_user: str | None,
    span: Span,
) -> Prepared:
    check_common(state, body)
    _check_chars(state, body.text_chars(), "prompt")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise invalid("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.loaded.tokenizer is None:
            raise invalid("this model takes token ids only", "prompt")
        token_ids = list(state.loaded.tokenizer.encode(prompt))
    else:
        token_ids = list(prompt)
        vocab = state.loaded.vocab_size
        if token_ids and max(token_ids) >= vocab:
            raise invalid(f"token ids must be in [0, {vocab})", "prompt")
    if not token_ids:
        raise invalid("the prompt is empty", "prompt")
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    return _prepare(
        state, "completions", body, token_ids, [], max_tokens, settlement, header_user, span
    )


def _check_chars(state: GatewayState, chars: int, param: str) -> None:
    """Refuse text that cannot fit before any template or tokenizer runs over it."""
    limit = state.settings.max_prompt_chars or 16 * state.max_prompt_tokens
    if chars > limit:
        message = f"the prompt has {chars} characters; the limit is {limit}"
        raise invalid(message, param, "context_length_exceeded")


def check_common(state: GatewayState, body: SamplingFields) -> None:
    if body.model != state.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist", "not_found_error",
                       "model", "model_not_found")  # fmt: skip
    if body.n != 1:
        raise invalid("only n=1 is supported", "n")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")


def _prepare(
    state: GatewayState,
    endpoint: str,
    body: SamplingFields,
    token_ids: list[int],
    spans: list[MessageSpan],
    max_tokens: int | None,
    settlement: Settlement,
    header_user: str | None,
    span: Span,
) -> Prepared:
    assert settlement.principal is not None  # the gate authenticated every request
    principal = settlement.principal
    prompt_tokens = len(token_ids)
    context = state.engine.max_model_len
    if prompt_tokens > state.max_prompt_tokens or prompt_tokens >= context:
        limit = min(state.max_prompt_tokens, context - 1)
        message = f"the prompt has {prompt_tokens} tokens; the limit is {limit}"
        raise invalid(message, prompt_param(endpoint), "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.settings.max_output_tokens, context - prompt_tokens)
    if max_tokens > state.settings.max_output_tokens:
        raise invalid(f"max_tokens may be at most {state.settings.max_output_tokens}",
                      "max_tokens")  # fmt: skip
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_list()),
        )
    except InvalidSampling as error:
        raise from_engine_error(error) from error
    user = user_scope_id(body.user, header_user, principal)
    tenant = principal.tenant
    with state.tracer.start_as_current_span("policy"):
        plan = state.policy.policy.plan(
            PolicyPrincipal(principal.tenant_id, user),
            TenantPolicy(tenant.sharing_mode, tenant.may_use_public_prefixes),
            state.model_name,
            token_ids,
            spans,
        )
    request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    request = GenerationRequest(
        request_id=request_id,
        tenant_id=principal.tenant_id,
        prompt_token_ids=token_ids,
        sampling=sampling,
        segments=plan.segments,
        tail_scope=plan.tail_scope,
        budget=TenantBudget(tenant.cache_quota_blocks, tenant.cache_reservation_blocks),
    )
    settlement.request_id = request_id
    settlement.details.update(
        user_hash=user_hash(state, principal.tenant_id, user), **scope_summary(plan)
    )
    return Prepared(
        endpoint=endpoint,
        request=request,
        plan=plan,
        settlement=settlement,
        stream=body.stream,
        include_usage=body.include_usage,
        span=span,
    )


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


def scope_summary(plan: Plan) -> dict[str, Any]:
    """What the audit log keeps about scopes: kinds and sizes, never user ids."""
    kinds = {Public: "public", Tenant: "tenant", User: "user"}
    return {
        "public_tokens": plan.public_tokens,
        "public_namespace": plan.public.namespace if plan.public else None,
        "private_scope": kinds.get(type(plan.tail_scope), "none"),
    }


def conclude(
    state: GatewayState,
    prepared: Prepared,
    outcome: str,
    usage: Usage | None = None,
    error: APIError | None = None,
    last: GenerationDelta | None = None,
) -> None:
    """Note how the request ended (the first conclusion wins); it is settled by the gate."""
    if prepared.settlement.outcome is not None:
        return
    timings = last.timings if last is not None else None
    prepared.settlement.conclude(outcome, usage, error, timings)
    if timings is not None:
        record_engine_phases(state.tracer, prepared.span, timings)


def engine_failure(error: Exception, prepared: Prepared) -> APIError:
    """The client's error for an exception from the engine."""
    if isinstance(error, ExceedsCacheQuota):  # say it in the tenant's terms, not its id
        message = f"tenant {prepared.principal.tenant_slug}: {error}"
        param = error.param if error.param != "messages" else prepared.prompt_param
        return invalid(message, param, "cache_quota_too_small")
    if isinstance(error, EngineError | InvalidSampling):
        api_error = from_engine_error(error)
        if api_error.param == "messages":  # the engine's name for the prompt
            api_error.param = prepared.prompt_param
        return api_error
    return APIError.internal()
