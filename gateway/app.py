"""The app factory: settings in, a FastAPI app out; heavy start-up happens in its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy import inspect
from starlette.concurrency import run_in_threadpool

from engine.model.loader import LoadedModel
from engine.model.openmp import on_passing_thread
from gateway.admin.routes import ROUTERS as ADMIN_ROUTERS
from gateway.auth.admin_tokens import AdminTokens
from gateway.auth.key_auth import KeyAuthenticator
from gateway.auth.login_throttle import LoginThrottle, SlidingWindow
from gateway.console import install_console
from gateway.errors import install_error_handlers
from gateway.http import system_routes as system
from gateway.http.middleware import BodySizeLimit, RequestGate
from gateway.http.openapi import install_openapi
from gateway.limits.limiter import Limiter
from gateway.limits.redis_store import RedisLimits
from gateway.limits.store import LimitStoreDown
from gateway.limits.tenant_turns import TenantTurns
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import make_tracer_provider
from gateway.openai import routes as completions
from gateway.runtime.audit_queue import AuditQueue
from gateway.runtime.engine_setup import start_local_engine, start_routing
from gateway.runtime.peers import REPORT_S, Peers, limits_store_id
from gateway.runtime.seal_keys import SealKeyCache
from gateway.runtime.served_models import ServedModels
from gateway.runtime.serving_engine import ServingEngine
from gateway.runtime.tenancy_sync import TenancySync
from gateway.runtime.usage_history import UsageHistory
from gateway.settings import Settings
from gateway.state import GatewayState
from policies.config import load_policy
from tenancy import deployment
from tenancy.change_feed import ChangeListener
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
        state.tenancy_listener.start()
        refresh_registry = state.models.refresh_registries
        background = [
            asyncio.create_task(
                _every(settings.registry_refresh_s, refresh_registry, "the prefix registry")
            ),
            asyncio.create_task(
                _every(settings.tenancy_poll_s, state.tenancy_sync.poll, "tenancy changes")
            ),
            asyncio.create_task(
                _every(settings.usage_sample_s, functools.partial(_sample_usage, state), "usage")
            ),
            asyncio.create_task(state.limiter.keep_leases()),
            asyncio.create_task(_every(REPORT_S, state.peers.report, "the gateways list")),
        ]
        await _check_shared_limits(state.limiter, announce)
        try:
            yield
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await run_in_threadpool(state.tenancy_listener.stop)
            state.draining = True
            await run_in_threadpool(shutdown_state, state)
            await state.limiter.close()
            await state.engine.close_connections()

    app = FastAPI(title="PrefixGate", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(completions.router)
    app.include_router(system.router)
    for admin_router in ADMIN_ROUTERS:
        app.include_router(admin_router)
    # The last added is outermost: the gate checks the key before the body is read.
    app.add_middleware(
        BodySizeLimit, max_bytes=settings.max_body_bytes, deadline_s=settings.body_read_timeout_s
    )
    app.add_middleware(RequestGate)
    install_console(app)  # /admin pages and assets, with their security headers outermost
    return app


def prepare_database(
    settings: Settings, announce: Callable[[str], None], first_steps: bool = True
) -> bool:
    """Create the schema on a brand-new database (and, with `first_steps`, say how to make a
    tenant and a key); refuse one that is behind. True if it created the schema."""
    engine = make_engine(settings.database_url)
    try:
        empty = not inspect(engine).get_table_names()
        if empty and current_revision(engine) is None:
            upgrade(settings.database_url)
            announce(f"created the database schema at {settings.database_url}")
            if first_steps:
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
    engine: ServingEngine
    if settings.workers:
        if settings.model_dir is not None or settings.served_model_name is not None:
            announce(
                "note: a gateway with workers serves the models its workers announce; --model "
                "and --served-model-name (PREFIXGATE_MODEL_DIR, PREFIXGATE_SERVED_MODEL_NAME) "
                "are the workers' settings and are ignored here"
            )
        engine = start_routing(settings)
        models = ServedModels(settings, policy_config, store, remote=engine)
    else:
        # Loaded and built on a thread that then ends: the engine thread's OpenMP pool stays
        # the only one (engine/model/openmp.py).
        loaded, local = on_passing_thread(lambda: start_local_engine(settings, loaded))
        models = ServedModels.one(settings, policy_config, store, local.served_name, loaded, local)
        engine = local
    announce("engine: " + ", ".join(f"{key} {value}" for key, value in engine.describe().items()))
    with store.transaction() as session:  # so the CLI can check quotas against the pool
        deployment.record_pool_blocks(session, engine.pool.num_blocks)
    auth = KeyAuthenticator(store, settings.auth_cache_ttl_s, settings.auth_stale_ttl_s)
    usage = UsageHistory(settings.usage_sample_s, settings.usage_window_s)
    seal_keys = None
    if settings.kv_tier != "off":
        seal_keys = SealKeyCache(store, settings.master_key_bytes())
        models.seal_keys = seal_keys
    tenancy_sync = TenancySync(store, engine, auth, usage, seal_keys)
    tenancy_sync.poll()
    tenant_names: dict[str, str] = {}
    limiter = make_limiter(settings)
    peers = Peers(store, limits_store_id(settings.redis_url, settings.redis_key_prefix))
    try:
        peers.report()
    except Exception:  # the list is advice: a gateway starts without it
        logger.warning("could not report this gateway to the database", exc_info=True)
    state = GatewayState(
        settings=settings,
        engine=engine,
        models=models,
        store=store,
        auth=auth,
        tenancy_sync=tenancy_sync,
        tenancy_listener=ChangeListener(store.engine, tenancy_sync.poll),
        limiter=limiter,
        peers=peers,
        metrics=GatewayMetrics(
            engine,
            store.audit,
            lambda tenant_id: tenant_names.get(tenant_id, tenant_id),
            limiter,
        ),
        tracer_provider=make_tracer_provider(settings.otlp_endpoint),
        audit=AuditQueue(store.audit, settings.audit_checkpoint_interval_s),
        prepare_slots=asyncio.Semaphore(settings.prepare_concurrency),
        compile_turns=TenantTurns(),
        admin_tokens=AdminTokens(
            secret=settings.secret("jwt_secret"),
            issuer=settings.admin_token_issuer,
            ttl_s=settings.admin_token_ttl_s,
            leeway_s=settings.admin_token_leeway_s,
        ),
        login_throttle=LoginThrottle(settings.admin_login_attempts_per_minute),
        admin_changes=SlidingWindow(settings.admin_changes_per_minute),
        usage=usage,
        tenant_names=tenant_names,
        seal_keys=seal_keys,
    )
    return state


def make_limiter(settings: Settings) -> Limiter:
    """The tenants' limits: in Redis when a URL is set (shared by every gateway), else here."""
    if settings.redis_url is None:
        return Limiter()
    shared = RedisLimits(
        settings.redis_url,
        settings.redis_key_prefix,
        settings.redis_timeout_s,
        settings.limit_lease_s,
    )
    return Limiter(shared, settings.limit_lease_s)


async def _check_shared_limits(limiter: Limiter, announce: Callable[[str], None]) -> None:
    """Say at start where tenants' limits are kept, after one try of the shared store."""
    if limiter.shared is None:
        announce(
            "limits: per process (PREFIXGATE_REDIS_URL is unset): with several gateways, "
            "each tenant gets its limits once per gateway"
        )
        return
    try:
        await limiter.shared.ping()
    except LimitStoreDown as error:
        limiter.shared_up = False
        announce(
            f"limits: Redis at {limiter.shared_where} does not answer ({error}); limiting "
            "in this process until it does (fail-open)"
        )
        return
    announce(f"limits: shared by every gateway in Redis at {limiter.shared_where}")


def shutdown_state(state: GatewayState) -> None:
    """Finish in-flight engine work, write queued audit events, close everything."""
    state.engine.stop(timeout=state.settings.shutdown_grace_s)
    state.audit.drain()
    with contextlib.suppress(Exception):
        state.peers.leave()
    with contextlib.suppress(Exception):
        state.store.audit.flush()
        state.store.audit.checkpoint_now()
    state.store.close()
    state.tracer_provider.shutdown()


def _sample_usage(state: GatewayState) -> None:
    state.usage.sample(state.engine.cache_stats(), state.engine.service_stats())


async def _every(seconds: float, work: Callable[[], object], what: str) -> None:
    """Run blocking `work` off the event loop every `seconds`: changes made by other
    processes (public prefixes, tenants, keys) reach this one."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await run_in_threadpool(work)
        except Exception:  # the database may be briefly away; keep what we have
            logger.warning("could not refresh %s", what, exc_info=True)
