"""How settings become what a process serves from: the checks made before anything loads, the
model, and a started engine, in this process or as engine workers behind a router.

The gateway (gateway/app.py) and the worker (gateway/worker_app.py) both start their engine
here, and the CLI checks settings here before either starts, so a device, an attention
backend or a worker address that cannot work is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

from engine.attention.selection import check_backend
from engine.cache.budget import TenantBudget
from engine.config import EngineConfig, TierConfig
from engine.engine import Engine
from engine.model.loader import EMBEDDED_MODEL_NAME, LoadedModel, ModelLoadError, load_model
from engine.precision import resolve_device, resolve_dtype
from engine.structured.compile_limits import CompileLimits
from gateway.runtime.local_engine import LocalEngine
from gateway.settings import Settings
from gateway.workers.addresses import parse_worker_spec
from gateway.workers.link import worker_link
from gateway.workers.membership import WorkerSet
from gateway.workers.remote_engine import RemoteEngine
from gateway.workers.routing import RoutingConfig
from tenancy.private_paths import private_directory


def check_engine(settings: Settings) -> None:
    """Refuse, before a model loads, a device or an attention backend named explicitly that
    cannot serve on this machine: ValueError saying why, in one line."""
    check_backend(settings.attention_backend, resolve_device(settings.device))


def check_workers(settings: Settings) -> None:
    """Refuse, before anything starts, worker addresses that cannot be read, or routing
    without the worker secret, the signing key, or TLS (unless plain HTTP was chosen):
    ValueError saying why, in one line."""
    for spec in settings.workers:
        parse_worker_spec(spec)
    if settings.workers:
        worker_link(settings)  # its certificates load here, once, to be checked


def load_configured_model(
    settings: Settings, model_dir: Path | None = None, weights: bool = True
) -> LoadedModel:
    """The model (`model_dir`, else the configured one, else the embedded one) on the
    configured device, in the configured dtype; without `weights`, only its shape and
    tokenizer. Raises `ModelLoadError` (also for a device that is not there)."""
    try:
        device = resolve_device(settings.device)
    except ValueError as error:
        raise ModelLoadError(str(error)) from error
    dtype = resolve_dtype(settings.dtype, device)
    template = None
    if settings.chat_template is not None:
        try:
            template = settings.chat_template.read_text()
        except (OSError, UnicodeDecodeError) as error:
            message = f"cannot read the chat template {settings.chat_template}: {error}"
            raise ModelLoadError(message) from error
    return load_model(
        model_dir or settings.model_dir,
        dtype=dtype,
        device=device,
        chat_template=template,
        weights=weights,
    )


# The public budget's pool quota when only its tier quota is set: as many blocks as any pool has.
UNLIMITED_BLOCKS = 2**31 - 1


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's configuration as the settings say."""
    public_budget = None
    if settings.public_cache_blocks is not None or settings.public_tier_quota_bytes is not None:
        blocks = settings.public_cache_blocks
        public_budget = TenantBudget(
            UNLIMITED_BLOCKS if blocks is None else blocks,
            tier_quota_bytes=settings.public_tier_quota_bytes,
        )
    return EngineConfig(
        block_size=settings.block_size,
        kv_cache_bytes=settings.kv_cache_bytes,
        gpu_memory_fraction=settings.gpu_memory_fraction,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        queue_timeout_s=settings.queue_timeout_s,
        scheduling=settings.scheduling,
        step_target_ms=settings.step_target_ms,
        enable_prefix_caching=settings.enable_prefix_caching,
        attention_backend=settings.attention_backend,
        public_budget=public_budget,
        compile_limits=compile_limits(settings),
        kv_tier=tier_config(settings),
        eviction=settings.kv_eviction,
    )


def tier_config(settings: Settings) -> TierConfig | None:
    """The second KV tier the settings ask for (None: none). A disk tier's file is named by
    the served model and the port, so a restarted worker finds its own file again."""
    if settings.kv_tier == "off":
        return None
    if settings.kv_tier == "disk" and settings.kv_tier_dir is None:
        # The tier's files go under the state directory: whoever makes it first makes it 0700.
        private_directory(settings.state_dir)
    return TierConfig(
        settings.kv_tier,
        settings.kv_tier_capacity_bytes,
        directory=settings.tier_dir,
        worker_name=f"{served_name(settings)}-{settings.port}",
        redis_url=settings.tier_redis_url,
        key_prefix=settings.redis_key_prefix,
    )


def compile_limits(settings: Settings) -> CompileLimits:
    """How long, with how much memory and how many at once grammars compile."""
    return CompileLimits(
        timeout_s=settings.grammar_compile_timeout_s,
        memory_mb=settings.grammar_compile_memory_mb,
        processes=settings.grammar_compile_processes,
    )


def start_engine(settings: Settings, loaded: LoadedModel | None) -> tuple[LoadedModel, Engine]:
    """The model (loaded unless given) and a started engine over it: a worker's."""
    if loaded is None:
        loaded = load_configured_model(settings)
    return loaded, Engine(loaded, engine_config(settings)).start()


def start_local_engine(
    settings: Settings, loaded: LoadedModel | None
) -> tuple[LoadedModel, LocalEngine]:
    """The model (loaded unless given) and a started engine over it: a gateway's own, serving
    under `served_name`."""
    if loaded is None:
        loaded = load_configured_model(settings)
    engine = LocalEngine(loaded, engine_config(settings), served_name=served_name(settings))
    engine.start()
    return loaded, engine


def served_name(settings: Settings) -> str:
    """The id clients name the model of a gateway's own engine by."""
    if settings.served_model_name:
        return settings.served_model_name
    return EMBEDDED_MODEL_NAME if settings.model_dir is None else Path(settings.model_dir).name


def start_routing(settings: Settings) -> RemoteEngine:
    """The workers, once one of them answers: a routing gateway serves whatever models they
    announce (it loads each one's tokenizer and shape from a worker, never weights)."""
    workers = WorkerSet(
        settings.workers,
        worker_link(settings),
        poll_s=settings.worker_poll_s,
        timeout_s=settings.worker_timeout_s,
    )
    config = RoutingConfig(
        mode=settings.routing,
        load_tokens=settings.routing_load_tokens,
        max_imbalance=settings.routing_max_imbalance,
    )
    engine = RemoteEngine(workers, config, compile_limits(settings))
    return engine.start(settings.worker_start_timeout_s)
