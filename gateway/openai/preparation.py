"""From an OpenAI request to engine work: template, policy plan, sampling.

The request path: route (gateway/openai/routes.py) -> preparation (here) -> serving
(serving.py) -> settlement (settlement.py). Here: size caps -> chat template -> token ids +
message spans -> policy plan (scopes) -> engine request carrying the tenant's budget and
scheduling weight. Everything here runs off the event loop, and its cost is linear in the
request's size, which is capped before the template runs. What the audit event keeps about the
plan goes to the request's `Settlement`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from opentelemetry.trace import Span

from engine.cache.budget import TenantBudget
from engine.cache.cache_request import SealKeys
from engine.cache.scope import NoCache, Public, Tenant, User
from engine.errors import EngineOverloaded, InvalidRequest
from engine.request import GenerationRequest
from engine.sampling.sampler import InvalidSampling, SamplingParams
from engine.structured.grammar import ResponseFormat
from engine.structured.tool_grammar import ToolCalls
from gateway.auth.key_auth import Caller
from gateway.errors import APIError, from_engine_error
from gateway.http.settlement import Settlement
from gateway.openai.responses import token_text
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonSchemaFormat,
    SamplingFields,
)
from gateway.openai.tool_calls import (
    template_supports_tools,
    to_template_messages,
    tool_choice_grammar,
)
from gateway.runtime.served_models import ServedModel
from gateway.state import GatewayState
from policies.planner import Plan, PlanSubject, TenantPolicy
from policies.templates import MessageSpan, TemplateRejected, render_with_spans

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
# Most token entries an echoed prompt's logprobs may list (about 15 MB of JSON).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One inference request as the gate let it in: where it goes, who sent it, its records."""

    endpoint: str  # "chat" or "completions"
    caller: Caller
    header_user: str | None  # the end user named by the X-PrefixGate-User header
    settlement: Settlement  # how the request ends, for its one audit event
    span: Span

    @classmethod
    def of(cls, settlement: Settlement, header_user: str | None, span: Span) -> RequestContext:
        """The context of an authenticated request, from the settlement the gate opened."""
        assert settlement.caller is not None  # the gate authenticated every /v1 request
        return cls(settlement.endpoint, settlement.caller, header_user, settlement, span)

    @property
    def prompt_param(self) -> str:
        """The request field that holds the prompt."""
        return "messages" if self.endpoint == "chat" else "prompt"


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated, planned request, ready for the engine."""

    context: RequestContext
    model: ServedModel  # the model it asked for: its tokenizer, its engine
    request: GenerationRequest
    plan: Plan
    stream: bool
    include_usage: bool
    # The prompt's text, for a completion that echoes it before its output.
    echo: str | None = None
    # Whether the output is read for tool calls (a chat request that gave the model tools).
    tool_calls: bool = False
    # The response format or tool-call grammar `request` still needs, compiled by
    # `with_grammar` once the request has left the shared preparation slots.
    grammar_wanted: ResponseFormat | ToolCalls | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return self.request.request_id


def prepare_chat(
    state: GatewayState, body: ChatCompletionRequest, context: RequestContext
) -> Prepared:
    """A chat request rendered by the model's own template, with its messages' spans."""
    model = _check_request(state, body, body.text_chars(), context.prompt_param)
    tokenizer = model.loaded.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        message = f"model {model.name} has no chat template; use /v1/completions"
        raise APIError.invalid(message)
    tools = _tools_shown(model, body)
    messages = [m.template_entry(_template_role(m.role)) for m in body.messages]
    try:
        messages = to_template_messages(messages)
        token_ids, spans = render_with_spans(tokenizer, messages, tools=tools)
    except (TemplateRejected, ValueError) as error:  # role order, special tokens, arguments
        message = f"the chat template rejected these messages: {error}"
        raise APIError.invalid(message, "messages") from error
    max_tokens = body.max_completion_tokens or body.max_tokens
    prepared = _prepare(state, model, context, body, token_ids, spans, max_tokens)
    return replace(prepared, tool_calls=tools is not None)


def _tools_shown(model: ServedModel, body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the template shows the model: none without `tools` or with tool_choice
    "none" (the answer may not call one). A template that cannot show tools is a 400, as are
    tool turns it could not render."""
    if body.tool_choice is not None and not body.tools:
        raise APIError.invalid("tool_choice needs tools", "tool_choice")
    tool_turns = any(m.tool_calls or m.role == "tool" for m in body.messages)
    shown = bool(body.tools) and body.tool_choice != "none"
    if (shown or tool_turns) and not template_supports_tools(model.loaded.tokenizer):
        message = f"model {model.name}'s chat template does not support tools"
        raise APIError.invalid(message, "tools" if shown else "messages")
    return body.tool_dicts() if shown else None


def prepare_completion(
    state: GatewayState, body: CompletionRequest, context: RequestContext
) -> Prepared:
    """A text completion request: one prompt, as text or as token ids."""
    model = _check_request(state, body, body.text_chars(), context.prompt_param)
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError.invalid("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    tokenizer = model.loaded.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError.invalid("this model takes token ids only", "prompt")
        token_ids = list(tokenizer.encode(prompt))
    else:  # ids past the vocabulary are refused by the engine's own check at submit
        token_ids = list(prompt)
    if not token_ids:  # the planner cannot plan an empty prompt
        raise APIError.invalid("the prompt is empty", "prompt")
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    prepared = _prepare(state, model, context, body, token_ids, [], max_tokens)
    if not body.echo:
        return prepared
    if not isinstance(prompt, str):
        prompt = "".join(token_text(tokenizer, token) for token in token_ids)
    return replace(prepared, echo=prompt)


def _check_request(
    state: GatewayState, body: SamplingFields, text_chars: int, prompt_param: str
) -> ServedModel:
    """The model the request names; refuse what cannot be served before any template or
    tokenizer runs over its text."""
    model = state.models.get(body.model)
    if model is None:
        raise APIError.model_not_found(body.model)
    if body.n > state.settings.max_choices:
        raise APIError.invalid(f"n may be at most {state.settings.max_choices}", "n")
    if body.stream_options is not None and not body.stream:
        message = "stream_options is only allowed with stream=true"
        raise APIError.invalid(message, "stream_options")
    limit = state.settings.max_prompt_chars or 16 * model.max_prompt_tokens
    if text_chars > limit:
        message = f"the prompt has {text_chars} characters; the limit is {limit}"
        raise APIError.invalid(message, prompt_param, "context_length_exceeded")
    return model


def _prepare(
    state: GatewayState,
    model: ServedModel,
    context: RequestContext,
    body: SamplingFields,
    token_ids: list[int],
    spans: list[MessageSpan],
    max_tokens: int | None,
) -> Prepared:
    """Check the prompt's length, plan its scopes and build the engine request."""
    prompt_tokens = len(token_ids)
    context_length = model.engine.max_model_len
    if prompt_tokens > model.max_prompt_tokens or prompt_tokens >= context_length:
        limit = min(model.max_prompt_tokens, context_length - 1)
        message = f"the prompt has {prompt_tokens} tokens; the limit is {limit}"
        raise APIError.invalid(message, context.prompt_param, "context_length_exceeded")
    caller, tenant = context.caller, context.caller.tenant
    # Without max_tokens, ask for no more than the context, the tenant's cache quota (the KV of
    # prompt + n x (max_tokens - 1) positions) and its tokens per minute hold, so a default
    # never makes a request unservable; when even those leave no room, the limit says why.
    n = body.n
    limits = (
        context_length - prompt_tokens,
        (tenant.cache_quota_blocks * state.settings.block_size - prompt_tokens) // n + 1,
        (tenant.tokens_per_minute - prompt_tokens) // n,
    )
    room = min(limits) if min(limits) > 0 else limits[0]
    sampling = _sampling(state, body, max_tokens, room)
    user = user_scope_id(body.user, context.header_user, caller)
    with state.tracer.start_as_current_span("policy"):
        plan = model.sharing.current.plan(
            PlanSubject(caller.tenant_id, user),
            TenantPolicy(tenant.sharing_mode, tenant.may_use_public_prefixes),
            model.name,
            token_ids,
            spans,
        )
    request_id = f"{'chatcmpl' if context.endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    forced = _forced_format(body)
    if forced is not None and body.stop is not None:  # it would cut where the output can't parse
        message = "stop cannot be combined with a response_format or a forced tool_choice"
        raise APIError.invalid(message, "stop")
    request = GenerationRequest(
        request_id=request_id,
        tenant_id=caller.tenant_id,
        prompt_token_ids=token_ids,
        sampling=sampling,
        segments=plan.segments,
        tail_scope=plan.tail_scope,
        budget=TenantBudget(
            tenant.cache_quota_blocks,
            tenant.cache_reservation_blocks,
            tenant.tier_quota_bytes,
            tenant.tier_reservation_bytes,
        ),
        weight=tenant.scheduling_weight,
        n=n,
        prompt_logprobs=_prompt_logprobs(body, prompt_tokens),
        seal_keys=_seal_keys(state, model, caller.tenant_id, plan),
    )
    settlement = context.settlement
    settlement.request_id = request_id
    settlement.details.update(
        user_hash=user_hash(state, caller.tenant_id, user), **scope_summary(plan)
    )
    return Prepared(
        context, model, request, plan, body.stream, body.include_usage, grammar_wanted=forced
    )


def _seal_keys(
    state: GatewayState, model: ServedModel, tenant_id: str, plan: Plan
) -> SealKeys | None:
    """The data keys the request's blocks are sealed with in the second tier (None: the
    deployment has none, or nothing of the request is cached)."""
    if state.seal_keys is None or isinstance(plan.tail_scope, NoCache):
        return None
    prefix_id = None if plan.public is None else model.sharing.prefix_id(plan.public)
    return state.seal_keys.for_request(tenant_id, prefix_id)


def with_grammar(state: GatewayState, prepared: Prepared) -> Prepared:
    """`prepared` with the grammar it wants compiled (on this thread, never the engine's, and
    outside the shared preparation slots: see gateway/limits/tenant_turns.py)."""
    if prepared.grammar_wanted is None:
        return prepared
    with state.tracer.start_as_current_span("grammar"):
        grammar = _compile_grammar(prepared.model, prepared.grammar_wanted)
    request = replace(prepared.request, grammar=grammar)
    return replace(prepared, request=request, grammar_wanted=None)


def _sampling(
    state: GatewayState, body: SamplingFields, max_tokens: int | None, room: int
) -> SamplingParams:
    """The engine's sampling parameters; without `max_tokens`, as many as there is `room` for,
    up to the server's limit."""
    limit = state.settings.max_output_tokens
    if max_tokens is None:
        max_tokens = min(limit, room)
    if max_tokens > limit:
        given = getattr(body, "max_completion_tokens", None)  # chat's newer name wins
        param = "max_completion_tokens" if given else "max_tokens"
        raise APIError.invalid(f"{param} may be at most {limit}", param)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_list()),
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            logit_bias=_logit_bias(body.logit_bias or {}),
            logprobs=_logprobs(body),
        )
    except InvalidSampling as error:
        raise from_engine_error(error) from error


def _forced_format(body: SamplingFields) -> ResponseFormat | ToolCalls | None:
    """What the output is held to: a response format, the tool calls tool_choice "required" or
    a named function allows, or None. Both at once is a 400. Only checks run here, inside the
    shared preparation slots; the grammar is written and compiled by `with_grammar`."""
    response_format = body.response_format
    wanted: ResponseFormat | None = None
    if isinstance(response_format, JsonSchemaFormat):
        wanted = ResponseFormat("json_schema", json.dumps(response_format.json_schema.schema_))
    elif response_format is not None and response_format.type == "json_object":
        wanted = ResponseFormat("json_object")
    if not isinstance(body, ChatCompletionRequest) or body.tool_choice in (None, "auto", "none"):
        return wanted
    if wanted is not None:
        message = "a tool_choice that forces a call cannot be combined with a response_format"
        raise APIError.invalid(message, "tool_choice")
    choice = body.tool_choice
    named = choice if isinstance(choice, str) else choice.model_dump()
    # A named function is called once (as vLLM does); "required" may make parallel calls
    # unless the request says otherwise (OpenAI's default is parallel).
    parallel = choice == "required" and body.parallel_tool_calls is not False
    try:
        return tool_choice_grammar(body.tool_dicts(), named, parallel)
    except InvalidRequest as error:
        raise from_engine_error(error) from None


def _compile_grammar(model: ServedModel, wanted: ResponseFormat | ToolCalls) -> Any:
    """A response format or a tool call grammar compiled for the model (on this preparation
    thread, never the engine's); what it cannot enforce is a 400 naming what."""
    try:
        if isinstance(wanted, ToolCalls):
            return model.engine.grammars.compile_tools(wanted)
        return model.engine.grammars.compile(wanted)
    except (InvalidRequest, EngineOverloaded) as error:
        raise from_engine_error(error) from None


def _logprobs(body: SamplingFields) -> int | None:
    """How many top alternatives each token's logprobs list (None: no logprobs): chat's
    `logprobs: true` + `top_logprobs`, or completions' `logprobs: k`."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            message = "top_logprobs needs logprobs: true"
            raise APIError.invalid(message, "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return None


def _prompt_logprobs(body: SamplingFields, prompt_tokens: int) -> int | None:
    """A completion that echoes its prompt with `logprobs: k` gets the prompt's too, for each
    of its n choices: at most MAX_PROMPT_LOGPROB_ENTRIES token entries in all."""
    if not isinstance(body, CompletionRequest) or not body.echo or body.logprobs is None:
        return None
    entries = body.n * prompt_tokens * (body.logprobs + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        message = (
            f"echo with logprobs would list {entries} token entries for the prompt "
            f"(n x prompt tokens x (logprobs + 1)); the limit is {MAX_PROMPT_LOGPROB_ENTRIES}"
        )
        raise APIError.invalid(message, "logprobs")
    return body.logprobs


def _logit_bias(given: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (id, bias) pairs; ids past the vocabulary are refused
    by the engine's check at submit."""
    pairs = []
    for key, bias in given.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise APIError.invalid(f"logit_bias: {key[:40]!r} is not a token id", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def user_scope_id(body_user: str | None, header_user: str | None, caller: Caller) -> str:
    """The end user inside the tenant, for private cache scopes.

    A header set by a proxy wins over the body's `user`; either is the client's own name, kept
    in a namespace of its own (`user:`), so no client can claim an API key's default scope
    (`key:<key id>`), which is what a request without a user gets.
    """
    named = header_user or body_user
    return f"user:{named}" if named else f"key:{caller.key_id}"


def user_hash(state: GatewayState, tenant_id: str, user: str) -> str:
    """The end user in audit events: a keyed hash, so a dictionary cannot reverse it."""
    message = f"audit-user\0{tenant_id}\0{user}".encode()
    return hmac.new(state.store.key_secret.encode(), message, hashlib.sha256).hexdigest()[:32]


def scope_summary(plan: Plan) -> dict[str, Any]:
    """What the audit log keeps about scopes: kinds and sizes, never user ids."""
    kinds = {Public: "public", Tenant: "tenant", User: "user"}
    return {
        "public_tokens": plan.public_tokens,
        "public_namespace": plan.public.namespace if plan.public else None,
        "private_scope": kinds.get(type(plan.tail_scope), "none"),
    }


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role
