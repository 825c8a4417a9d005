"""The engine thread's warm-up: what a first request would otherwise pay, paid before the
engine says it serves.

A thread's first steps pay for what later steps find ready: libgomp starts the thread's team
of OpenMP workers at its first parallel region (a served process had no OpenMP worker before
its first request and one after, counted with gdb), and the first large activations come
from fresh pages, which malloc keeps for later ones only once such a size has been freed.
The calibration (engine/step_cost.py) runs on the thread that builds the engine, and that
thread ends; so `Engine.start` has the engine thread itself run, before it returns, a prompt
chunk of up to `CHUNK_TOKENS` and a few decode steps after it, in the pool's first blocks
(free at start: nothing has been admitted), zeroed afterwards. The chunk is kept short so
that start-up stays short on a busy machine, where a step can take ten times its usual time.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.cache.block_pool import BlockPool
from engine.model.runner import ModelRunner
from engine.step_cost import synthetic_step_ms

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 512
DECODE_STEPS = 4


def warm_up(runner: ModelRunner, pool: BlockPool, chunk_tokens: int, max_model_len: int) -> float:
    """Run a prompt chunk of up to `chunk_tokens` (cut to `CHUNK_TOKENS`, and to half the pool
    and of the model's length) and up to `DECODE_STEPS` decodes after it on the calling thread,
    in blocks nothing else holds; the seconds it took."""
    started = time.perf_counter()
    capacity = pool.num_blocks * pool.spec.block_size
    tokens = max(1, min(chunk_tokens, CHUNK_TOKENS, capacity // 2, max_model_len // 2))
    decodes = max(0, min(DECODE_STEPS, capacity - tokens, max_model_len - tokens))
    blocks = list(range(-(-(tokens + decodes) // pool.spec.block_size)))
    computed = runner.computed_tokens
    try:
        synthetic_step_ms(runner, blocks, tokens, 0)
        for position in range(tokens, tokens + decodes):
            synthetic_step_ms(runner, blocks, 1, position)
    finally:
        runner.computed_tokens = computed  # the warm-up's tokens are not requests' work
        pool.zero_blocks(pool.kv, torch.tensor(blocks, device=pool.kv.device))
    took = time.perf_counter() - started
    logger.info("engine: warmed up in %.2f s (a %d-token chunk, %d decodes)", took, tokens, decodes)
    return took
