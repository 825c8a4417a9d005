"""Paged-attention test cases shared by the kernel tests: sequences over a scattered block pool,
and a float64 reference that gathers and masks explicitly."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Case:
    """Sequences given as (query_len, context_len), over a pool of `num_blocks` blocks."""

    lengths: list[tuple[int, int]]
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    window: int = 0
    num_blocks: int = 64
    shared_blocks: int = 1  # leading blocks every table shares with the first

    @property
    def longest_query(self) -> int:
        return max(query_len for query_len, _ in self.lengths)


@dataclass
class Inputs:
    """One case's tensors, laid out as the engine hands them to a kernel."""

    query: torch.Tensor  # [tokens, heads, dim], not contiguous (as transformers gives it)
    key_cache: torch.Tensor  # [blocks, block_size, kv_heads, dim]
    value_cache: torch.Tensor
    tables: torch.Tensor  # int32 [sequences, max_blocks]
    starts: torch.Tensor  # int32 [sequences + 1]
    contexts: torch.Tensor  # int32 [sequences]


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> Inputs:
    generator = torch.Generator().manual_seed(seed)
    shape = (case.num_blocks, case.block_size, case.kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    most_blocks = max(math.ceil(context / case.block_size) for _, context in case.lengths)
    # Scattered, non-contiguous blocks; every row shares its first `shared_blocks` blocks with
    # row 0 (a shared prefix is the same physical blocks in several tables).
    tables = torch.stack(
        [torch.randperm(case.num_blocks, generator=generator)[:most_blocks] for _ in case.lengths]
    )
    tables[:, : case.shared_blocks] = tables[0, : case.shared_blocks].clone()
    tokens = sum(query_len for query_len, _ in case.lengths)
    query = torch.randn(case.heads, tokens, case.head_dim, generator=generator).to(dtype)
    starts = [0]
    for query_len, _ in case.lengths:
        starts.append(starts[-1] + query_len)
    return Inputs(
        query=query.transpose(0, 1),
        key_cache=key_cache,
        value_cache=value_cache,
        tables=tables.int(),
        starts=torch.tensor(starts, dtype=torch.int32),
        contexts=torch.tensor([context for _, context in case.lengths], dtype=torch.int32),
    )


def reference(inputs: Inputs, lengths: list[tuple[int, int]], window: int) -> torch.Tensor:
    """Gather each sequence's context and attend in float64 with an explicit mask."""
    query, key_cache, value_cache = inputs.query, inputs.key_cache, inputs.value_cache
    block_size, kv_heads, dim = key_cache.shape[1:]
    group = query.shape[1] // kv_heads
    outputs, start = [], 0
    for row, (query_len, context_len) in enumerate(lengths):
        blocks = inputs.tables[row, : math.ceil(context_len / block_size)].long()
        keys = key_cache[blocks].reshape(-1, kv_heads, dim)[:context_len].double()
        values = value_cache[blocks].reshape(-1, kv_heads, dim)[:context_len].double()
        queries = query[start : start + query_len].double()
        start += query_len
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * dim**-0.5
        query_positions = torch.arange(context_len - query_len, context_len)[:, None]
        key_positions = torch.arange(context_len)[None, :]
        visible = key_positions <= query_positions
        if window:
            visible &= key_positions > query_positions - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(outputs)


CASES = {
    "single-token": Case([(1, 1)]),
    "decode-batch-odd-lengths": Case([(1, 1), (1, 17), (1, 33), (1, 100), (1, 16)]),
    "prefill-odd-length": Case([(37, 37)]),
    "extend-over-prefix-ending-mid-block": Case([(11, 50), (23, 40)]),
    "mixed-decode-prefill-extend": Case([(1, 77), (45, 45), (9, 120), (1, 2)]),
    "gqa-1": Case([(1, 40), (20, 60)], heads=4, kv_heads=4),
    "gqa-4": Case([(1, 40), (20, 60)], heads=8, kv_heads=2),
    "head-dim-64-block-8": Case(
        [(1, 70), (30, 70)], heads=9, kv_heads=3, head_dim=64, block_size=8
    ),
    "block-32": Case([(1, 70), (30, 100)], block_size=32),
    # Heads of 16 and 48 dims end half-way through a 32-element bf16 vector.
    "head-dim-16": Case([(1, 40), (1, 17), (20, 60)], heads=4, kv_heads=2, head_dim=16),
    "head-dim-48": Case([(1, 40), (1, 33), (20, 60)], heads=6, kv_heads=3, head_dim=48),
    "sliding-window": Case([(1, 90), (40, 90), (5, 30)], window=24),
    "window-of-one": Case([(3, 20)], window=1),
    "long-tile-boundaries": Case([(70, 200), (1, 300)], num_blocks=64),
    # Decode sequences whose tables begin with the same 18 blocks (288 keys) attend over them
    # together, in two pieces of keys: four members (12 rows per KV head), one ending just after
    # the prefix, one far past it; beside them a prefill over the same blocks, not a member.
    "decode-sharing-a-prefix": Case(
        [(1, 300), (1, 289), (1, 290), (1, 700), (40, 320)],
        heads=9,
        kv_heads=3,
        head_dim=64,
        shared_blocks=18,
        num_blocks=160,
    ),
    # Two members of 3 query heads per KV head (6 rows, padded to 16 for the products).
    "decode-pair-sharing-a-prefix": Case([(1, 170), (1, 200)], shared_blocks=10, num_blocks=64),
    # Ten members of 8 query heads per KV head (80 rows, padded to 96 for the products), blocks
    # of 8 and 21 shared of them (168 keys, of which 160 shared: a multiple of 16).
    "decode-many-sharing-a-prefix-block-8": Case(
        [(1, 170 + 7 * i) for i in range(10)],
        heads=16,
        kv_heads=2,
        head_dim=32,
        block_size=8,
        shared_blocks=21,
        num_blocks=400,
    ),
    # head_dim 128, blocks of 32.
    "decode-sharing-a-prefix-head-dim-128": Case(
        [(1, 300), (1, 333), (1, 290)],
        heads=4,
        kv_heads=2,
        head_dim=128,
        block_size=32,
        shared_blocks=9,
        num_blocks=64,
    ),
    # A short extend (2 tokens: 6 rows, the decode loop's rows at two positions) and a decode
    # under a window wider than a 256-key decode segment, which then starts and ends mid-chunk;
    # and heads of 256 dims.
    "window-across-decode-segments": Case([(2, 300), (1, 600)], window=275, num_blocks=64),
    "head-dim-256": Case([(1, 300), (2, 40)], heads=2, kv_heads=1, head_dim=256, num_blocks=32),
    # A sliding window makes each member see its own range: no sharing, same answers.
    "decode-sharing-a-prefix-with-a-window": Case(
        [(1, 300), (1, 290)], window=100, shared_blocks=18, num_blocks=64
    ),
}
