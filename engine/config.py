"""Engine settings: pool size, batching limits, timeouts, backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from engine.cache.budget import TenantBudget
from engine.cache.eviction import EvictionPolicy
from engine.step_cost import StepCost
from engine.structured.compile_limits import CompileLimits


@dataclass(frozen=True, slots=True)
class TierConfig:
    """A second KV tier (engine/cache/tier/): a file of this worker's on local disk, or a
    Redis store every worker of the model shares."""

    kind: Literal["disk", "redis"]
    capacity_bytes: int
    directory: Path | None = None  # disk: where `<worker_name>.tier` lives
    worker_name: str = "worker"
    redis_url: str | None = None  # redis: the store, keys under `key_prefix`
    key_prefix: str = "prefixgate"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How big the KV pool is and how the scheduler batches.

    The pool holds `num_blocks` blocks if given, else as many as fit in `kv_cache_bytes`;
    without either, 1 GiB on a CPU, and on a CUDA device what `gpu_memory_fraction` of its
    memory leaves after the weights and the activations (`engine/model/gpu_memory.py`).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.9
    kv_dtype: torch.dtype | None = None  # default: the model's dtype
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting: int = 4096
    queue_timeout_s: float = 30.0
    enable_prefix_caching: bool = True
    # Warm the engine thread up before it serves (engine/warm_up.py): a server's first
    # requests then run as fast as its later ones; a one-request command need not.
    warm_up: bool = True
    attention_backend: str = "auto"  # auto, cpu, torch or triton: see engine/attention/selection.py
    adapter_id: str = ""
    # Which idle cached block is evicted first: "value" (the least expected prefill time saved
    # per byte) or "lru" (the least recently used, kept for comparison); engine/cache/eviction.py.
    eviction: EvictionPolicy = "value"
    # Blocks that leave the pool live on, sealed per tenant, in a second tier (None: none).
    kv_tier: TierConfig | None = None
    public_budget: TenantBudget | None = None
    default_budget: TenantBudget | None = None
    # "fair": service counted per tenant over time and steps kept short while another
    # tenant's light work waits on them (engine/fairness.py); "per_step": the budget of each
    # step split equally between the tenants with work, nothing remembered between steps and
    # no step-time cap (the scheduling before fairness over time, kept for comparison).
    scheduling: Literal["fair", "per_step"] = "fair"
    # The step-time target of a step that carries another tenant's light work, in ms; None:
    # from the cost model calibrated at start (engine/step_cost.py).
    step_target_ms: float | None = None
    # The cost model steps are predicted with; None: calibrated at start.
    step_cost: StepCost | None = None
    # The time and memory one structured-output grammar may take to compile, and how many
    # compile at once (engine/structured/compile_pool.py).
    compile_limits: CompileLimits = field(default_factory=CompileLimits)
