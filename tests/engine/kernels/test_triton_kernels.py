"""The Triton kernels against plain references: paged attention (decode with and without
split-K, prefill and extend), KV writes and block zeroing.

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
from engine.kernels.triton.decode import Splits, decode_attention, plan_splits
from engine.kernels.triton.kv_write import write_kv
from engine.kernels.triton.prefill import prefill_attention
from engine.kernels.triton.zero import zero_blocks
from tests.support.attention_cases import CASES, Case, Inputs, make_inputs, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def attend(inputs: Inputs, case: Case, splits: Splits | None = None) -> torch.Tensor:
    """Both kernels over the batch, as the backend calls them; untouched rows stay NaN."""
    on_device = [
        tensor.to(DEVICE)
        for tensor in (inputs.query, inputs.key_cache, inputs.value_cache, inputs.tables,
                       inputs.starts, inputs.contexts)
    ]  # fmt: skip
    output = torch.full(inputs.query.shape, float("nan"), dtype=inputs.query.dtype, device=DEVICE)
    arguments = (*on_device, case.head_dim**-0.5, case.window)
    if splits is None:
        spans = [min(context, case.window or context) for _, context in case.lengths]
        splits = plan_splits(max(spans), len(case.lengths) * case.kv_heads, 1)
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
    # Contexts cut into 3 and 5 splits; the shorter sequences leave later splits empty.
    "three-splits": (Case([(1, 300), (1, 17), (1, 600)], num_blocks=80), Splits(3, 256)),
    "five-splits": (Case([(1, 300), (1, 17), (1, 600)], num_blocks=80), Splits(5, 128)),
    "splits-in-a-window": (Case([(1, 300), (1, 90), (4, 50)], window=100), Splits(2, 64)),
    "gqa-4-splits": (Case([(1, 200), (1, 130)], heads=8, kv_heads=2), Splits(4, 64)),
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


def test_split_plan_fills_the_device_without_tiny_splits() -> None:
    # 32 sequences x 8 KV heads already fill 128 multiprocessors twice: no split.
    assert plan_splits(4096, 32 * 8, 128) == Splits(1, 4096)
    # One sequence of 4k on 132 multiprocessors: cut, but no split under 256 positions.
    one = plan_splits(4096, 8, 132)
    assert one.count == 16 and one.tokens == 256
    # Short contexts are never split; every split covers whole 64-position tiles.
    assert plan_splits(200, 1, 132) == Splits(1, 256)
    for span, programs in ((1000, 3), (4097, 8), (65_000, 1)):
        splits = plan_splits(span, programs, 132)
        assert splits.tokens % 64 == 0 and splits.count * splits.tokens >= span
        assert (splits.count - 1) * splits.tokens < span  # no split is empty for the longest


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
