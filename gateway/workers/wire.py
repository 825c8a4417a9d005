"""What crosses between a gateway and its engine workers, as JSON.

Requests go out as token ids, scoped segments, sampling, the tenant's budget and scheduling
weight, and a serialized grammar; deltas and engine errors come back. Prompt text never
crosses: a worker sees what the in-process engine sees. Engine errors keep their type, so the
gateway answers a worker's refusal exactly as it answers its own engine's.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any

from engine import errors
from engine.cache.budget import PUBLIC_OWNER, Owner, TenantBudget
from engine.cache.cache_request import SealKeys
from engine.cache.quotas import OwnerCounters
from engine.cache.scope import NO_CACHE, CacheScope, NoCache, Public, Segment, Tenant, User
from engine.cache.stats import CacheStats, OwnerStats
from engine.cache.tier.sealing import SealKey
from engine.request import CacheSources, GenerationDelta, GenerationRequest, Timings, Usage
from engine.sampling.sampler import SamplingParams, TokenLogprobs
from engine.structured.grammar import serialized
from tenancy.errors import InvalidInput
from tenancy.tenants import check_scheduling_weight

Json = dict[str, Any]


class WireError(ValueError):
    """A message that does not have the shape this module writes."""


# -- scopes, budgets, owners ------------------------------------------------------------------


def scope_json(scope: CacheScope) -> Json:
    match scope:
        case Public(namespace):
            return {"kind": "public", "namespace": namespace}
        case Tenant(tenant_id):
            return {"kind": "tenant", "tenant_id": tenant_id}
        case User(tenant_id, user_id):
            return {"kind": "user", "tenant_id": tenant_id, "user_id": user_id}
        case NoCache():
            return {"kind": "none"}
    raise TypeError(f"not a cache scope: {scope!r}")


def read_scope(data: Json) -> CacheScope:
    kind = data.get("kind")
    if kind == "public":
        return Public(_text(data, "namespace"))
    if kind == "tenant":
        return Tenant(_text(data, "tenant_id"))
    if kind == "user":
        return User(_text(data, "tenant_id"), _text(data, "user_id"))
    if kind == "none":
        return NO_CACHE
    raise WireError(f"unknown scope kind {kind!r}")


def budget_json(budget: TenantBudget) -> Json:
    return {
        "quota_blocks": budget.quota_blocks,
        "reserved_blocks": budget.reserved_blocks,
        "tier_quota_bytes": budget.tier_quota_bytes,
        "tier_reserved_bytes": budget.tier_reserved_bytes,
    }


def read_budget(data: Json) -> TenantBudget:
    try:
        tier_quota = data.get("tier_quota_bytes")
        if tier_quota is not None and type(tier_quota) is not int:
            raise WireError("tier_quota_bytes must be null or an integer")
        return TenantBudget(
            _int(data, "quota_blocks"),
            _int(data, "reserved_blocks"),
            tier_quota,
            _int(data, "tier_reserved_bytes") if "tier_reserved_bytes" in data else 0,
        )
    except WireError:
        raise
    except ValueError as error:  # negative, or a reservation over the quota
        raise WireError(f"budget: {error}") from None


def _seal_key_json(key: SealKey) -> Json:
    return {"key_id": key.key_id, "secret": base64.b64encode(key.secret).decode()}


def _read_seal_key(data: Json) -> SealKey:
    try:
        secret = base64.b64decode(_text(data, "secret"), validate=True)
        return SealKey(_text(data, "key_id"), secret)
    except (binascii.Error, ValueError) as error:
        raise WireError(f"seal key: {error}") from None


def seal_keys_json(keys: SealKeys) -> Json:
    """The request's data keys (only ever sent to workers over the authenticated link)."""
    public = None if keys.public is None else _seal_key_json(keys.public)
    return {"tenant": _seal_key_json(keys.tenant), "public": public}


def read_seal_keys(data: Json) -> SealKeys:
    public = data.get("public")
    return SealKeys(
        _read_seal_key(data["tenant"]), None if public is None else _read_seal_key(public)
    )


def owner_json(owner: Owner) -> str:
    """A tenant id, or "" for the public budget (tenant ids are never empty)."""
    return "" if owner is PUBLIC_OWNER else str(owner)


def read_owner(text: str) -> Owner:
    return PUBLIC_OWNER if text == "" else text


# -- requests ---------------------------------------------------------------------------------


def request_json(request: GenerationRequest) -> Json:
    sampling = dataclasses.asdict(request.sampling)
    return {
        "request_id": request.request_id,
        "tenant_id": request.tenant_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "sampling": sampling,
        "segments": [
            {"start": s.start, "end": s.end, "scope": scope_json(s.scope)} for s in request.segments
        ],
        "tail_scope": scope_json(request.tail_scope),
        "budget": None if request.budget is None else budget_json(request.budget),
        "weight": request.weight,
        "grammar": None if request.grammar is None else serialized(request.grammar),
        "n": request.n,
        "prompt_logprobs": request.prompt_logprobs,
        "seal_keys": None if request.seal_keys is None else seal_keys_json(request.seal_keys),
    }


def read_request(data: Json, compile_grammar: Any) -> GenerationRequest:
    """The request `request_json` wrote; `compile_grammar(text)` compiles its grammar.

    Raises `WireError` for a malformed message; the sampling parameters' own checks raise
    `InvalidSampling`, the grammar's `InvalidRequest`.
    """
    try:
        token_ids = data["prompt_token_ids"]
        if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
            raise WireError("prompt_token_ids must be a list of integers")
        sampling = dict(data["sampling"])
        for name in ("stop", "stop_token_ids"):
            sampling[name] = tuple(sampling.get(name) or ())
        sampling["logit_bias"] = tuple(
            (int(token), float(bias)) for token, bias in sampling.get("logit_bias") or ()
        )
        segments = [
            Segment(_int(s, "start"), _int(s, "end"), read_scope(s["scope"]))
            for s in data["segments"]
        ]
        ends = [(segment.start, segment.end) for segment in segments]
        if segments and [0, *(end for _, end in ends)] != [
            *(start for start, _ in ends),
            len(token_ids),
        ]:
            raise WireError("segments must tile the prompt, in order")
        prompt_logprobs = data.get("prompt_logprobs")
        if prompt_logprobs is not None and type(prompt_logprobs) is not int:
            raise WireError("prompt_logprobs must be null or an integer")
        budget = None if data.get("budget") is None else read_budget(data["budget"])
        seal_keys = data.get("seal_keys")
        grammar_text = data.get("grammar")
        return GenerationRequest(
            request_id=_text(data, "request_id"),
            tenant_id=_text(data, "tenant_id"),
            prompt_token_ids=token_ids,
            sampling=SamplingParams(**sampling),
            segments=segments,
            tail_scope=read_scope(data["tail_scope"]),
            budget=budget,
            weight=_read_weight(data),
            grammar=None if grammar_text is None else compile_grammar(str(grammar_text)),
            n=_int(data, "n"),
            prompt_logprobs=prompt_logprobs,
            seal_keys=None if seal_keys is None else read_seal_keys(seal_keys),
        )
    except KeyError as error:
        raise WireError(f"malformed request: {error.args[0]} is missing") from None
    except (TypeError, AttributeError) as error:
        raise WireError(f"malformed request: {error}") from None


def _read_weight(data: Json) -> float:
    """The request's scheduling weight; 1.0 from a gateway that sends none (an older one)."""
    weight = data.get("weight", 1.0)
    if type(weight) not in (int, float):
        raise WireError("weight must be a number")
    try:
        return check_scheduling_weight(float(weight))
    except InvalidInput as error:
        raise WireError(str(error)) from None


# -- deltas -----------------------------------------------------------------------------------


def _logprobs_json(items: list[TokenLogprobs] | None) -> list[Json] | None:
    if items is None:
        return None
    return [{"token": i.token, "logprob": i.logprob, "top": i.top} for i in items]


def _read_logprobs(items: list[Json] | None) -> list[TokenLogprobs] | None:
    if items is None:
        return None
    return [
        TokenLogprobs(
            int(i["token"]), float(i["logprob"]), tuple((int(t), float(v)) for t, v in i["top"])
        )
        for i in items
    ]


def delta_json(delta: GenerationDelta) -> Json:
    return {
        "text": delta.text,
        "token_ids": delta.token_ids,
        "finish_reason": delta.finish_reason,
        "logprobs": _logprobs_json(delta.logprobs),
        "prompt_logprobs": _logprobs_json(delta.prompt_logprobs),
        "index": delta.index,
        "usage": None if delta.usage is None else dataclasses.asdict(delta.usage),
        "timings": None if delta.timings is None else dataclasses.asdict(delta.timings),
    }


def read_delta(data: Json) -> GenerationDelta:
    try:
        usage, timings = data.get("usage"), data.get("timings")
        return GenerationDelta(
            text=str(data["text"]),
            token_ids=[int(t) for t in data["token_ids"]],
            finish_reason=data.get("finish_reason"),
            logprobs=_read_logprobs(data.get("logprobs")),
            prompt_logprobs=_read_logprobs(data.get("prompt_logprobs")),
            index=int(data.get("index", 0)),
            usage=None if usage is None else _read_usage(usage),
            timings=None if timings is None else Timings(**timings),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise WireError(f"malformed delta: {error!r}") from None


def _read_usage(data: Json) -> Usage:
    cache = data.pop("cache", None)
    sources = None
    if cache is not None:
        sources = CacheSources(
            {str(k): int(v) for k, v in cache["cached"].items()},
            int(cache["tier_loads"]),
            int(cache["tier_bytes"]),
            {str(k): int(v) for k, v in cache["evicted"].items()},
        )
    return Usage(**data, cache=sources)


# -- engine errors ----------------------------------------------------------------------------

# The engine errors that cross by name; anything else arrives as a plain EngineError.
_ERRORS: dict[str, type[errors.EngineError]] = {
    cls.__name__: cls
    for cls in (
        errors.EngineError,
        errors.InvalidRequest,
        errors.RequestFailed,
        errors.CacheQuotaTimeout,
        errors.PoolTimeout,
        errors.EngineOverloaded,
        errors.EngineRestarted,
        errors.EngineStopped,
        errors.TenantDeleted,
    )
}


def error_json(error: errors.EngineError) -> Json:
    data: Json = {"type": type(error).__name__, "message": str(error)}
    if isinstance(error, errors.InvalidRequest):
        data["param"] = error.param
    if isinstance(error, errors.ExceedsCacheQuota):
        data["needed_tokens"] = error.needed_tokens
        data["quota_tokens"] = error.quota_tokens
    return data


def read_error(data: Json) -> errors.EngineError:
    kind, message = str(data.get("type")), str(data.get("message", "the worker failed"))
    if kind == "ContextTooLong":
        return errors.ContextTooLong(message)
    if kind == "ExceedsCacheQuota":
        return errors.ExceedsCacheQuota(
            message,
            int(data.get("needed_tokens", 0)),
            int(data.get("quota_tokens", 0)),
            str(data.get("param") or "messages"),
        )
    if kind == "InvalidRequest":
        return errors.InvalidRequest(message, data.get("param"))
    return _ERRORS.get(kind, errors.EngineError)(message)


# -- cache statistics -------------------------------------------------------------------------


def stats_json(stats: CacheStats) -> Json:
    data = dataclasses.asdict(stats)
    data["owners"] = {
        owner_json(owner): dataclasses.asdict(value) for owner, value in stats.owners.items()
    }
    return data


def read_stats(data: Json) -> CacheStats:
    try:
        owners: dict[Owner, OwnerStats] = {}
        for owner, value in data["owners"].items():
            counters = OwnerCounters(**value.pop("counters"))
            owners[read_owner(owner)] = OwnerStats(**value, counters=counters)
        fields = {k: v for k, v in data.items() if k != "owners"}
        return CacheStats(**fields, owners=owners)
    except (KeyError, TypeError, AttributeError) as error:
        raise WireError(f"malformed cache statistics: {error!r}") from None


def _text(data: Json, name: str) -> str:
    value = data[name]
    if not isinstance(value, str):
        raise WireError(f"{name} must be a string")
    return value


def _int(data: Json, name: str) -> int:
    value = data[name]
    if type(value) is not int:
        raise WireError(f"{name} must be an integer")
    return value
