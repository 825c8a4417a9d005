"""The Triton kernels against plain references: paged attention (decode with and without
split-K, prefill and extend), KV writes and block zeroing; and decode's batch invariance (a
sequence's output bits do not depend on what shares its step).

Without a GPU they run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes stay small; `bench/gpu_check.sh` runs this file natively on
a CUDA machine. Tolerances: fp32 agrees with the float64 reference to 2e-5 (products in full
fp32, not tf32); bf16 to 1.6e-2, the rounding of bf16 outputs and of the softmax weights
(rounded to bf16 before the product with V, as on the GPU).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import TritonAttention
from engine.kernels.triton.decode import (
    MAX_SPLITS,
    decode_attention,
    plan_splits,
    split_count,
    split_tokens,
)
from engine.kernels.triton.kv_write import write_kv
from engine.kernels.triton.prefill import prefill_attention
from engine.kernels.triton.zero import zero_blocks
from tests.support.attention_cases import CASES, Case, Inputs, make_inputs, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def attend(inputs: Inputs, case: Case, splits: int | None = None) -> torch.Tensor:
    """Both kernels over the batch, as the backend calls them; untouched rows stay NaN."""
    on_device = [
        tensor.to(DEVICE)
        for tensor in (inputs.query, inputs.key_cache, inputs.value_cache, inputs.tables,
                       inputs.starts, inputs.contexts)
    ]  # fmt: skip
    output = torch.full(inputs.query.shape, float("nan"), dtype=inputs.query.dtype, device=DEVICE)
    arguments = (*on_device, case.head_dim**-0.5, case.window)
    if splits is None:  # as the backend plans it
        spans = [
            min(context, case.window or context)
            for query_len, context in case.lengths
            if query_len == 1
        ]
        splits = plan_splits(spans)
    decode_attention(output, *arguments, splits)
    if case.longest_query > 1:
        prefill_attention(output, *arguments, case.longest_query)
    return output.cpu().double()


@DTYPES
@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_matches_the_float64_reference(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    inputs = make_inputs(case, dtype)
    expected = reference(inputs, case.lengths, case.window)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(attend(inputs, case), expected, atol=tolerance, rtol=tolerance)


SPLIT_CASES = {
    # 600 positions in 3 splits of 256, 300 in 2, 17 in one (written directly).
    "three-splits": (Case([(1, 300), (1, 17), (1, 600)], num_blocks=80), None),
    # A grid wider than any sequence needs: the programs past a sequence's splits do nothing.
    "grid-of-five-splits": (Case([(1, 300), (1, 17), (1, 600)], num_blocks=80), 5),
    # A window of 300 over 700 positions: 2 splits from position 400, a prefill beside them.
    "splits-in-a-window": (Case([(1, 700), (1, 90), (4, 50)], window=300), None),
    "gqa-4-splits": (Case([(1, 600), (1, 130)], heads=8, kv_heads=2), None),
}


@DTYPES
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_split_k_decode_matches_the_reference(name: str, dtype: torch.dtype) -> None:
    case, splits = SPLIT_CASES[name]
    inputs = make_inputs(case, dtype, seed=3)
    expected = reference(inputs, case.lengths, case.window)
    tolerance = TOLERANCE[dtype]
    output = attend(inputs, case, splits)
    torch.testing.assert_close(output, expected, atol=tolerance, rtol=tolerance)


def test_splits_grow_past_max_splits_of_256_positions() -> None:
    # 16,448 positions: 52 splits of 320, as the host plans them (fp32 only: 9 s a dtype).
    case = Case([(1, 16_448), (1, 40)], heads=2, kv_heads=1, head_dim=16, block_size=64,
                num_blocks=260, shared_blocks=0)  # fmt: skip
    inputs = make_inputs(case, torch.float32, seed=3)
    expected = reference(inputs, case.lengths, case.window)
    tolerance = TOLERANCE[torch.float32]
    torch.testing.assert_close(attend(inputs, case), expected, atol=tolerance, rtol=tolerance)


def test_a_sequences_splits_follow_from_its_own_span_alone() -> None:
    # Up to MAX_SPLITS x 256 positions, splits of 256: short contexts are never split.
    assert [split_count(span) for span in (1, 200, 256, 257, 700, 4096)] == [1, 1, 1, 2, 3, 16]
    assert split_tokens(16_384) == 256 and split_count(16_384) == MAX_SPLITS
    # Longer, the splits grow by whole 64-position tiles to keep to MAX_SPLITS.
    assert split_tokens(16_385) == 320 and split_count(16_448) == 52
    for span in (1, 255, 1000, 4097, 16_385, 65_000, 1 << 20):
        per, count = split_tokens(span), split_count(span)
        assert per % 64 == 0 and per >= 256 and 1 <= count <= MAX_SPLITS
        assert count * per >= span and (count - 1) * per < span  # none of its own is empty
    # The grid needs as many splits as the most any sequence needs; nothing else counts.
    assert plan_splits([100, 700, 300]) == 3 and plan_splits([100] * 500) == 1
    assert plan_splits([]) == 1


def test_attention_reads_nothing_outside_the_tables_blocks() -> None:
    case = Case([(1, 40), (12, 30)], num_blocks=16)
    inputs = make_inputs(case, torch.float32, seed=1)
    expected = attend(inputs, case)
    used = {int(block) for row in inputs.tables for block in row}
    row_blocks = [inputs.tables[0, :3].tolist(), inputs.tables[1, :2].tolist()]
    for block in range(case.num_blocks):
        if block not in used:
            inputs.key_cache[block] = inputs.value_cache[block] = float("nan")
    # The unused tail of each row's last block: row 0 holds 40 = 2 x 16 + 8, row 1 30 = 16 + 14.
    for blocks, used_slots in zip(row_blocks, (8, 14), strict=True):
        if blocks[-1] not in (row_blocks[0][:-1] + row_blocks[1][:-1]):
            inputs.key_cache[blocks[-1], used_slots:] = float("nan")
            inputs.value_cache[blocks[-1], used_slots:] = float("nan")
    output = attend(inputs, case)
    assert not output.isnan().any()
    assert torch.equal(output, expected)


# Batch invariance: the same sequences, alone and among others of every kind (longer ones that
# widen the grid to 6 splits, shorter ones, prefills), give the same output bits.
INVARIANCE_POOL = Case([], heads=6, kv_heads=2, head_dim=32, block_size=16, num_blocks=96)
# Three splits of their own (700) and one (100: written directly whatever the grid).
TARGETS = [(1, 700), (1, 100)]


def other_lengths(count: int) -> list[tuple[int, int]]:
    """`count` sequences beside the targets: the first longer than both (a grid of 6 splits),
    then short and long decodes, and every fifth a prefill or extend."""
    contexts = [1300, 5, 300, 64, 600, 17, 270, 130]
    return [
        (2 + 3 * (i % 7), 40 + 13 * i) if i % 5 == 2 else (1, contexts[i % 8] + i)
        for i in range(count)
    ]


def first_rows(
    sequences: list[tuple[int, int, int]], dtype: torch.dtype, window: int = 0
) -> list[torch.Tensor]:
    """Attend a batch of `(query_len, context, seed)` over one shared K/V pool and return each
    sequence's first output row. A sequence's query rows and block table come from its own
    seed, so it is the same sequence in every batch it joins."""
    pool = INVARIANCE_POOL
    generator = torch.Generator().manual_seed(0)
    shape = (pool.num_blocks, pool.block_size, pool.kv_heads, pool.head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    widths = [-(-context // pool.block_size) for _, context, _ in sequences]
    tables = torch.zeros(len(sequences), max(widths), dtype=torch.int32)
    queries, starts = [], [0]
    for row, (query_len, _, seed) in enumerate(sequences):
        own = torch.Generator().manual_seed(seed)
        tables[row, : widths[row]] = torch.randperm(pool.num_blocks, generator=own)[: widths[row]]
        queries.append(torch.randn(query_len, pool.heads, pool.head_dim, generator=own))
        starts.append(starts[-1] + query_len)
    inputs = Inputs(
        torch.cat(queries).to(dtype),
        key_cache,
        value_cache,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([context for _, context, _ in sequences], dtype=torch.int32),
    )
    lengths = [(query_len, context) for query_len, context, _ in sequences]
    case = Case(lengths, pool.heads, pool.kv_heads, pool.head_dim, pool.block_size, window)
    output = attend(inputs, case)
    return [output[start] for start in starts[:-1]]


def targets_alone_and_among(
    others: list[tuple[int, int]], dtype: torch.dtype, window: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The targets' output rows each alone, and in one batch with `others`: the first target
    in the middle, the second last."""
    targets = [(*target, seed) for seed, target in enumerate(TARGETS, start=1)]
    alone = [first_rows([target], dtype, window)[0] for target in targets]
    rest = [(*other, 100 + i) for i, other in enumerate(others)]
    middle = len(rest) // 2
    among = first_rows([*rest[:middle], targets[0], *rest[middle:], targets[1]], dtype, window)
    return alone, [among[middle], among[-1]]


@DTYPES
@pytest.mark.parametrize("others", [1, 7, 31])
def test_a_decoding_sequences_bits_do_not_depend_on_its_batch(
    others: int, dtype: torch.dtype
) -> None:
    lengths = other_lengths(others)
    spans = [context for query_len, context in lengths if query_len == 1]
    assert plan_splits(spans) == 6  # a wider grid than either target needs alone
    alone, among = targets_alone_and_among(lengths, dtype)
    for target, own, shared in zip(TARGETS, alone, among, strict=True):
        assert not own.isnan().any()
        assert torch.equal(own, shared), f"context {target[1]} alone vs among {others} others"


def test_a_decoding_sequences_bits_do_not_depend_on_its_batch_under_a_window() -> None:
    # A window of 500: the 700 context's two splits start at position 200.
    alone, among = targets_alone_and_among(other_lengths(7), torch.float32, window=500)
    for own, shared in zip(alone, among, strict=True):
        assert torch.equal(own, shared)


@DTYPES
def test_kv_write_scatters_each_token_to_its_slot(dtype: torch.dtype) -> None:
    layers, blocks, block_size, kv_heads, dim = 2, 10, 5, 2, 16  # a block size not a power of 2
    kv = torch.zeros(layers, 2, blocks, block_size, kv_heads, dim, dtype=dtype, device=DEVICE)
    # Keys as transformers hands them over: [tokens, heads, dim] transposed (not contiguous).
    key = torch.randn(kv_heads, 7, dim).to(dtype).transpose(0, 1).to(DEVICE)
    value = torch.randn(7, kv_heads, dim).to(dtype).to(DEVICE)
    slots = torch.tensor([3, 4, 10, 11, 12, 49, -1], device=DEVICE)  # -1: skipped
    write_kv(kv[1, 0], kv[1, 1], key, value, slots)
    expected = torch.zeros_like(kv)
    written = slots >= 0
    expected[1, 0].view(-1, kv_heads, dim)[slots[written]] = key[written]
    expected[1, 1].view(-1, kv_heads, dim)[slots[written]] = value[written]
    assert torch.equal(kv, expected)


def test_kv_write_converts_to_the_pools_dtype() -> None:
    kv = torch.zeros(1, 2, 4, 16, 3, 32, dtype=torch.bfloat16, device=DEVICE)
    key, value = torch.randn(2, 5, 3, 32, device=DEVICE)
    slots = torch.tensor([0, 17, 18, 40, 63], device=DEVICE)
    write_kv(kv[0, 0], kv[0, 1], key, value, slots)
    for cache, source in ((kv[0, 0], key), (kv[0, 1], value)):
        stored = cache.reshape(-1, 3, 32)[slots].float()
        # Round to nearest on a GPU; the interpreter truncates: within one bf16 step either way.
        torch.testing.assert_close(stored, source, atol=0, rtol=2**-7)


@DTYPES
@pytest.mark.parametrize(
    "shape",
    [(3, 10, 4, 2, 16), (2, 6, 16, 4, 128)],  # the second: 8,192-element runs, two per block
    ids=["small", "two-runs-per-block"],
)
def test_zeroing_clears_the_listed_blocks_in_every_layer_and_nothing_else(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    layers, blocks, *rest = shape
    kv = torch.randn(layers, 2, blocks, *rest).to(dtype).to(DEVICE)
    before = kv.clone()
    listed = torch.tensor([4, 1, blocks - 1], device=DEVICE)
    zero_blocks(kv, listed)
    zeroed = torch.zeros(blocks, dtype=torch.bool, device=DEVICE)
    zeroed[listed] = True
    assert (kv[:, :, zeroed] == 0).all()  # K and V, every layer
    assert torch.equal(kv[:, :, ~zeroed], before[:, :, ~zeroed])
    zero_blocks(kv, torch.tensor([], dtype=torch.long, device=DEVICE))  # nothing to do
    assert (kv[:, :, zeroed] == 0).all() and torch.equal(kv[:, :, ~zeroed], before[:, :, ~zeroed])


def test_backend_refuses_a_cpu_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.attention.selection import check_backend
    from engine.kernels import KernelUnavailable

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailable, match="need a CUDA device, not cpu"):
        TritonAttention.create(torch.device("cpu"))
    with pytest.raises(ValueError, match="attention backend 'triton' is unavailable"):
        check_backend("triton", torch.device("cpu"))
