"""The C++ CPU kernel against a plain float64 reference, and its refusals of bad input.

Tolerances: fp32 pools agree to 2e-5 (the kernel's exp is a polynomial, relative error < 2e-7,
and sums run in a different order); bf16 pools to 1.6e-2, bf16's own rounding of the output
(8 bits of mantissa on values up to ~2).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_build

cpu_build.load()
paged_attention = torch.ops.prefixgate.paged_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


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


def reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: list[tuple[int, int]],
    window: int,
) -> torch.Tensor:
    """Gather each sequence's context and attend in float64 with an explicit mask."""
    block_size, kv_heads, dim = key_cache.shape[1:]
    group = query.shape[1] // kv_heads
    outputs, start = [], 0
    for row, (query_len, context_len) in enumerate(lengths):
        blocks = tables[row, : math.ceil(context_len / block_size)].long()
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


def run_case(case: Case, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (case.num_blocks, case.block_size, case.kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    most_blocks = max(math.ceil(context / case.block_size) for _, context in case.lengths)
    # Scattered, non-contiguous blocks; every row shares its first block with row 0 (a shared
    # prefix is the same physical block in several tables).
    tables = torch.stack(
        [torch.randperm(case.num_blocks, generator=generator)[:most_blocks] for _ in case.lengths]
    )
    tables[:, 0] = tables[0, 0]
    tokens = sum(query_len for query_len, _ in case.lengths)
    # Queries as transformers hands them over: [heads, tokens, dim] transposed (not contiguous).
    query = torch.randn(case.heads, tokens, case.head_dim, generator=generator).to(dtype)
    query = query.transpose(0, 1)
    starts = [0]
    for query_len, _ in case.lengths:
        starts.append(starts[-1] + query_len)
    output = torch.empty(tokens, case.heads, case.head_dim, dtype=dtype)
    paged_attention(
        output,
        query,
        key_cache,
        value_cache,
        tables.int(),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([context for _, context in case.lengths], dtype=torch.int32),
        case.head_dim**-0.5,
        case.window,
    )
    expected = reference(query, key_cache, value_cache, tables, case.lengths, case.window)
    return output.double(), expected


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
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_the_float64_reference(name: str, dtype: torch.dtype) -> None:
    output, expected = run_case(CASES[name], dtype)
    torch.testing.assert_close(output, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_kernel_reads_nothing_outside_the_tables_blocks() -> None:
    case = Case([(1, 40), (12, 30)], num_blocks=16)
    generator = torch.Generator().manual_seed(1)
    shape = (case.num_blocks, case.block_size, case.kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=generator)
    value_cache = torch.randn(shape, generator=generator)
    tables = torch.tensor([[3, 5, 7], [9, 11, 11]])  # the second row is padded with its own
    starts = torch.tensor([0, 1, 13], dtype=torch.int32)
    contexts = torch.tensor([40, 30], dtype=torch.int32)
    query = torch.randn(13, case.heads, case.head_dim, generator=generator)
    expected = torch.empty_like(query)
    arguments = (tables.int(), starts, contexts, case.head_dim**-0.5, 0)
    paged_attention(expected, query, key_cache, value_cache, *arguments)
    # Poison every block no table names, and the unused tail of the last block of each row.
    poisoned = torch.ones(case.num_blocks, dtype=torch.bool)
    poisoned[[3, 5, 7, 9, 11]] = False
    key_cache[poisoned] = float("nan")
    value_cache[poisoned] = float("nan")
    key_cache[7, 8:] = value_cache[7, 8:] = float("nan")  # row 0: 40 = 2 x 16 + 8
    key_cache[11, 14:] = value_cache[11, 14:] = float("nan")  # row 1: 30 = 16 + 14
    output = torch.empty_like(query)
    paged_attention(output, query, key_cache, value_cache, *arguments)
    assert torch.equal(output, expected)


def _valid_arguments() -> dict[str, object]:
    key_cache = torch.zeros(4, 16, 2, 32)
    return {
        "out": torch.empty(3, 4, 32),
        "query": torch.zeros(3, 4, 32),
        "key_cache": key_cache,
        "value_cache": key_cache.clone(),
        "block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "query_starts": torch.tensor([0, 1, 3], dtype=torch.int32),
        "context_lens": torch.tensor([20, 2], dtype=torch.int32),
        "scale": 1.0,
        "window": 0,
    }


BAD_INPUTS = {
    "block id out of range": {"block_tables": torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)},
    "block table shorter than the context": {
        "context_lens": torch.tensor([40, 2], dtype=torch.int32)
    },
    "queries must fit": {"query_starts": torch.tensor([0, 1, 4], dtype=torch.int32)},
    "int32": {"block_tables": torch.tensor([[0, 1], [2, 3]])},
    "share one dtype": {"query": torch.zeros(3, 4, 32, dtype=torch.bfloat16)},
    "head_dim must be a multiple of 16": {
        "out": torch.empty(3, 4, 24),
        "query": torch.zeros(3, 4, 24),
        "key_cache": torch.zeros(4, 16, 2, 24),
        "value_cache": torch.zeros(4, 16, 2, 24),
    },
    "unsupported GQA ratio": {"out": torch.empty(3, 3, 32), "query": torch.zeros(3, 3, 32)},
}


@pytest.mark.parametrize("message", sorted(BAD_INPUTS))
def test_bad_input_is_an_error_not_a_crash(message: str) -> None:
    arguments = _valid_arguments() | BAD_INPUTS[message]
    with pytest.raises(RuntimeError, match=message):
        paged_attention(**arguments)


FALLBACK_PROBE = """
import time, torch
from engine.attention import make_backend
cpu = torch.device("cpu")
print(make_backend("auto", cpu, 64).name)
started = time.perf_counter()
print(make_backend("auto", cpu, 64).name, time.perf_counter() - started < 1.0)
try:
    make_backend("cpu", cpu, 64)
except ValueError as error:
    print("refused:", str(error).splitlines()[0][:60])
"""


def test_without_a_compiler_auto_serves_with_torch_and_cpu_refuses(tmp_path: Path) -> None:
    # A fresh process (this one has the kernel loaded), an empty kernel cache, no compiler.
    environment = os.environ | {"CXX": str(tmp_path / "no-compiler"),
                                "PREFIXGATE_KERNEL_CACHE": str(tmp_path / "kernels")}  # fmt: skip
    probe = subprocess.run(
        [sys.executable, "-c", FALLBACK_PROBE],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # The first failure is remembered: the second engine does not try to compile again.
    assert probe.stdout.splitlines() == [
        "torch",
        "torch True",
        "refused: attention backend 'cpu' is unavailable: cannot build the CPU",
    ]
    assert "attention backend: torch (cannot build the CPU kernels" in probe.stderr
