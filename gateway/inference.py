"""From an OpenAI request to engine work: template, policy plan, sampling, limits, audit.

chat template -> token ids + message spans -> policy plan (scopes) -> engine request carrying
the tenant's budget -> deltas. Every finished, failed or cancelled request leaves one audit
event and its metrics.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from engine.budget import TenantBudget
from engine.errors import EngineError
from engine.request import GenerationDelta, GenerationRequest, Usage
from engine.sampler import InvalidSampling, SamplingParams
from engine.scope import Public, Tenant, User
from gateway.auth import Principal
from gateway.errors import APIError, from_engine_error, invalid
from gateway.limits import Admission
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.state import GatewayState
from gateway.tracing import record_engine_phases
from policies.planner import MessageSpan, Plan, TenantPolicy
from policies.planner import Principal as PolicyPrincipal
from policies.templates import render_with_spans
from tenancy.audit_chain import AuditRecord

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint


@dataclass
class Prepared:
    """A validated, planned request, ready for the engine."""

    endpoint: str
    request: GenerationRequest
    plan: Plan
    principal: Principal
    user_hash: str
    stream: bool
    include_usage: bool
    source_ip: str | None
    span: Span
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    admission: Admission | None = None
    finished: bool = False


def user_scope_id(body: SamplingFields, header_user: str | None, principal: Principal) -> str:
    """The end user inside the tenant: `user` field, else the header, else the API key."""
    return body.user or header_user or f"key:{principal.key_id}"


def prepare_chat(
    state: GatewayState,
    body: ChatCompletionRequest,
    principal: Principal,
    header_user: str | None,
    source_ip: str | None,
    span: Span,
) -> Prepared:
    check_common(state, body)
    tokenizer = state.loaded.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise invalid(f"model {state.model_name} has no chat template; use /v1/completions")
    messages = [{"role": _template_role(m.role), "content": m.text()} for m in body.messages]
    try:
        token_ids, spans = render_with_spans(tokenizer, messages)
    except Exception as error:  # a template that rejects this conversation (role order, ...)
        raise invalid(f"the chat template rejected these messages: {error}", "messages") from error
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _prepare(state, "chat", body, token_ids, spans, max_tokens, principal, header_user,
                    source_ip, span)  # fmt: skip


def prepare_completion(
    state: GatewayState,
    body: CompletionRequest,
    principal: Principal,
    header_user: str | None,
    source_ip: str | None,
    span: Span,
) -> Prepared:
    check_common(state, body)
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
    if not token_ids:
        raise invalid("the prompt is empty", "prompt")
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    return _prepare(state, "completions", body, token_ids, [], max_tokens, principal,
                    header_user, source_ip, span)  # fmt: skip


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
    principal: Principal,
    header_user: str | None,
    source_ip: str | None,
    span: Span,
) -> Prepared:
    prompt_tokens = len(token_ids)
    context = state.engine.max_model_len
    if prompt_tokens > state.max_prompt_tokens or prompt_tokens >= context:
        limit = min(state.max_prompt_tokens, context - 1)
        raise invalid(f"the prompt has {prompt_tokens} tokens; the limit is {limit}",
                      "messages", "context_length_exceeded")  # fmt: skip
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
    user = user_scope_id(body, header_user, principal)
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
    return Prepared(
        endpoint=endpoint,
        request=request,
        plan=plan,
        principal=principal,
        user_hash=hashlib.sha256(f"{principal.tenant_id}:{user}".encode()).hexdigest()[:16],
        stream=body.stream,
        include_usage=body.include_usage,
        source_ip=source_ip,
        span=span,
        response_id=request_id,
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


def finish(
    state: GatewayState,
    prepared: Prepared,
    outcome: str,
    usage: Usage | None = None,
    status: int = 200,
    error: str | None = None,
    last: GenerationDelta | None = None,
) -> None:
    """Metrics, audit event, tracing and limiter release for a request that ended (once)."""
    if prepared.finished:
        return
    prepared.finished = True
    seconds = time.perf_counter() - prepared.started
    tenant = prepared.principal.tenant_slug
    metrics = state.metrics
    metrics.requests.labels(prepared.endpoint, str(status)).inc()
    metrics.latency.labels(prepared.endpoint).observe(seconds)
    if usage is not None:
        metrics.prompt_tokens.labels(tenant).inc(usage.prompt_tokens)
        metrics.cached_tokens.labels(tenant).inc(usage.cached_tokens)
        metrics.completion_tokens.labels(tenant).inc(usage.completion_tokens)
    if last is not None and last.timings is not None:
        metrics.ttft.observe(max(0.0, last.timings.first_token - last.timings.arrived))
        record_engine_phases(state.tracer, prepared.span, last.timings)
    if prepared.admission is not None:
        used = None if usage is None else usage.prompt_tokens + usage.completion_tokens
        prepared.admission.release(used)
    details: dict[str, Any] = {
        "model": state.model_name,
        "endpoint": prepared.endpoint,
        "user_hash": prepared.user_hash,
        "latency_ms": round(seconds * 1000, 2),
        "status": status,
        **scope_summary(prepared.plan),
    }
    if usage is not None:
        details.update(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
        )
    if error:
        details["error"] = error
    state.audit.put(
        AuditRecord(
            actor_type="api_key",
            actor_id=prepared.principal.key_id,
            tenant_id=prepared.principal.tenant_id,
            action=f"inference.{prepared.endpoint}",
            resource_type="model",
            resource_id=state.model_name,
            outcome=outcome,
            request_id=prepared.response_id,
            source_ip=prepared.source_ip,
            details=details,
        )
    )


def engine_failure(error: Exception) -> APIError:
    if isinstance(error, EngineError | InvalidSampling):
        return from_engine_error(error)
    return APIError(500, "internal server error", "server_error")
