"""The app factory: settings in, a FastAPI app out; heavy start-up happens in its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from sqlalchemy import inspect
from starlette.concurrency import run_in_threadpool

from engine.budget import TenantBudget
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_loader import EMBEDDED_MODEL_NAME, LoadedModel, load_model
from gateway.api.routes import inference, system
from gateway.audit_queue import AuditQueue
from gateway.auth import KeyAuthenticator
from gateway.errors import APIError, install_error_handlers
from gateway.limits import RateLimiter
from gateway.metrics import GatewayMetrics
from gateway.middleware import BodySizeLimit, BodyTooLarge
from gateway.settings import Settings
from gateway.state import GatewayState, PolicyHolder
from gateway.tracing import make_tracer_provider
from policies.config import load_policy
from tenancy.db import make_engine
from tenancy.migrate import current_revision, ensure_current, upgrade

logger = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    loaded: LoadedModel | None = None,
    announce: Callable[[str], None] = print,
    on_ready: Callable[[GatewayState], None] | None = None,
) -> FastAPI:
    """The gateway app. `loaded` skips model loading (tests, benchmarks); `announce` prints
    start-up notes (first-start instructions)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await run_in_threadpool(build_state, settings, loaded, announce)
        app.state.gateway = state
        if on_ready is not None:
            on_ready(state)
        refresher = asyncio.create_task(_refresh_registry(state))
        try:
            yield
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            state.draining = True
            await run_in_threadpool(shutdown_state, state)

    app = FastAPI(title="PrefixGate", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: object, __: BodyTooLarge) -> object:
        return APIError(413, f"the request body is larger than {settings.max_body_bytes} bytes",
                        "invalid_request_error", None, "request_too_large").response()  # fmt: skip

    app.include_router(inference.router)
    app.include_router(system.router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app


def prepare_database(settings: Settings, announce: Callable[[str], None]) -> bool:
    """Create the schema on a brand-new database (and say how to start); refuse one that is
    behind. True if it created the schema."""
    engine = make_engine(settings.database_url)
    try:
        empty = not inspect(engine).get_table_names()
        if empty and current_revision(engine) is None:
            upgrade(settings.database_url)
            announce(f"created the database schema at {settings.database_url}")
            announce(
                "first start: create a tenant and an API key with\n"
                "  prefixgate tenants create my-team\n"
                "  prefixgate keys create --tenant my-team"
            )
            return True
        ensure_current(settings.database_url, engine)
        return False
    finally:
        engine.dispose()


def build_state(
    settings: Settings, loaded: LoadedModel | None, announce: Callable[[str], None]
) -> GatewayState:
    prepare_database(settings, announce)
    policy_config = load_policy(settings.policy_file)
    store = settings.open_store()
    if loaded is None:
        loaded = load_model(settings.model_dir)
    model_name = settings.served_model_name or (
        EMBEDDED_MODEL_NAME if settings.model_dir is None else Path(settings.model_dir).name
    )
    public_budget = None
    if settings.public_cache_blocks is not None:
        public_budget = TenantBudget(settings.public_cache_blocks)
    engine = Engine(
        loaded,
        EngineConfig(
            block_size=settings.block_size,
            kv_cache_bytes=settings.kv_cache_bytes,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            queue_timeout_s=settings.queue_timeout_s,
            enable_prefix_caching=settings.enable_prefix_caching,
            public_budget=public_budget,
        ),
    ).start()
    policy = PolicyHolder(policy_config, loaded, model_name, settings.block_size)
    policy.refresh(store)
    tenant_names: dict[str, str] = {}
    state = GatewayState(
        settings=settings,
        loaded=loaded,
        engine=engine,
        store=store,
        model_name=model_name,
        policy=policy,
        auth=KeyAuthenticator(store, settings.auth_cache_ttl_s, settings.auth_stale_ttl_s),
        limiter=RateLimiter(),
        metrics=GatewayMetrics(engine, lambda tenant_id: tenant_names.get(tenant_id, tenant_id)),
        tracer_provider=make_tracer_provider(settings.otlp_endpoint),
        audit=AuditQueue(store.audit),
        max_prompt_tokens=settings.max_prompt_tokens or engine.max_model_len - 1,
        tenant_names=tenant_names,
    )
    return state


def shutdown_state(state: GatewayState) -> None:
    """Finish in-flight engine work, write queued audit events, close everything."""
    state.engine.stop(timeout=state.settings.shutdown_grace_s)
    state.audit.drain()
    with contextlib.suppress(Exception):
        state.store.audit.flush()
        state.store.audit.checkpoint_now()
    state.store.close()
    state.tracer_provider.shutdown()


async def _refresh_registry(state: GatewayState) -> None:
    """Pick up public prefixes registered, disabled or deleted by other processes."""
    while True:
        await asyncio.sleep(state.settings.registry_refresh_s)
        try:
            await run_in_threadpool(state.policy.refresh, state.store)
        except Exception:  # the database may be briefly away; keep the current registry
            logger.warning("could not refresh the public-prefix registry", exc_info=True)
