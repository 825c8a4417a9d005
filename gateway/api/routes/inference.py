"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.deps import PrincipalDep, StateDep, UserHeaderDep, client_ip
from gateway.auth import Principal
from gateway.errors import APIError
from gateway.inference import Prepared, prepare_chat, prepare_completion
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.serving import respond
from gateway.state import GatewayState
from tenancy.audit_chain import AuditRecord

router = APIRouter(prefix="/v1", tags=["inference"])


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    state: StateDep,
    principal: PrincipalDep,
    user: UserHeaderDep = None,
) -> Response:
    return await _serve(state, request, principal, "chat",
                        lambda span: prepare_chat(state, body, principal, user,
                                                  client_ip(request), span))  # fmt: skip


@router.post("/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    state: StateDep,
    principal: PrincipalDep,
    user: UserHeaderDep = None,
) -> Response:
    return await _serve(state, request, principal, "completions",
                        lambda span: prepare_completion(state, body, principal, user,
                                                        client_ip(request), span))  # fmt: skip


async def _serve(
    state: GatewayState,
    request: Request,
    principal: Principal,
    endpoint: str,
    prepare: Callable[..., Prepared],
) -> Response:
    with state.tracer.start_as_current_span(f"inference.{endpoint}") as span:
        span.set_attribute("prefixgate.tenant", principal.tenant_slug)
        try:
            prepared = prepare(span)
        except APIError as error:
            _audit_rejected(state, request, principal, endpoint, error)
            raise
        span.set_attribute("prefixgate.prompt_tokens", len(prepared.request.prompt_token_ids))
        span.set_attribute("prefixgate.public_tokens", prepared.plan.public_tokens)
        return await respond(state, prepared, request)


def _audit_rejected(
    state: GatewayState, request: Request, principal: Principal, endpoint: str, error: APIError
) -> None:
    state.metrics.requests.labels(endpoint, str(error.status)).inc()
    state.audit.put(
        AuditRecord(
            actor_type="api_key",
            actor_id=principal.key_id,
            tenant_id=principal.tenant_id,
            action=f"inference.{endpoint}",
            resource_type="model",
            resource_id=state.model_name,
            outcome="rejected",
            source_ip=client_ip(request),
            details={"status": error.status, "error": error.code or error.error_type,
                     "param": error.param},
        )
    )  # fmt: skip
