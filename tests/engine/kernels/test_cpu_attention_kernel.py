"""The C++ CPU kernel against a plain float64 reference, and its refusals of bad input.

Tolerances: fp32 pools agree to 2e-5 (the kernel's exp is a polynomial, relative error < 2e-7,
and sums run in a different order); bf16 pools to 1.6e-2, bf16's own rounding of the output
(8 bits of mantissa on values up to ~2).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from tests.support import matrix_products
from tests.support.attention_cases import CASES, Case, Inputs, make_inputs, reference

cpu_build.load()
paged_attention = torch.ops.prefixgate.paged_attention


def run_case(case: Case, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = make_inputs(case, dtype, seed)
    output = torch.empty(inputs.query.shape, dtype=dtype)
    paged_attention(
        output,
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.tables,
        inputs.starts,
        inputs.contexts,
        case.head_dim**-0.5,
        case.window,
        torch.zeros(len(case.lengths), dtype=torch.int32),  # one share group: sharing allowed
    )
    return output.double(), reference(inputs, case.lengths, case.window)


@pytest.fixture(params=["vector", "amx", "dot"])
def bf16_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """bf16 prefill and extend of 16 or more tokens run as matrix products where the CPU has
    them (AMX, or bf16_product.h's loops: AVX512_BF16's vdpbf16ps, AVX2's FMA), else on the
    vector kernel; each path is tested where the CPU has it."""
    yield from matrix_products.take(request.param)


@pytest.fixture(params=["amx", "dot"])
def matrix_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The matrix path on each kind of products this CPU has."""
    yield from matrix_products.take(request.param)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_kernel_matches_the_float64_reference(name: str) -> None:
    output, expected = run_case(CASES[name], torch.float32)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_kernel_matches_the_float64_reference(name: str, bf16_path: str) -> None:
    output, expected = run_case(CASES[name], torch.bfloat16)
    torch.testing.assert_close(output, expected, atol=1.6e-2, rtol=1.6e-2)


def test_matrix_path_runs_long_prefills_over_many_key_tiles(bf16_path: str) -> None:
    # Contexts past several 256-key tiles, with a window that starts mid-tile, and a sequence
    # just under the matrix path's 16 tokens beside them.
    for case in (
        Case([(300, 700), (15, 515), (1, 600)], num_blocks=160),
        Case([(280, 600)], heads=9, kv_heads=3, head_dim=64, window=300, num_blocks=64),
    ):
        output, expected = run_case(case, torch.bfloat16)
        torch.testing.assert_close(output, expected, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_reads_nothing_outside_the_tables_blocks(dtype: torch.dtype, bf16_path: str) -> None:
    # A decode (bf16: the segmented decode loop) and a prompt chunk (bf16 with matrix units:
    # packed into a 256-key tile, whose keys past the context must come from nowhere).
    case = Case([(1, 40), (12, 30)], num_blocks=16)
    generator = torch.Generator().manual_seed(1)
    shape = (case.num_blocks, case.block_size, case.kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.tensor([[3, 5, 7], [9, 11, 11]])  # the second row is padded with its own
    starts = torch.tensor([0, 1, 13], dtype=torch.int32)
    contexts = torch.tensor([40, 30], dtype=torch.int32)
    query = torch.randn(13, case.heads, case.head_dim, generator=generator).to(dtype)
    expected = torch.empty_like(query)
    prompts = torch.tensor([0, 1], dtype=torch.int32)
    arguments = (tables.int(), starts, contexts, case.head_dim**-0.5, 0, None, prompts)
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
    "queries must cover the batch": {"query_starts": torch.tensor([0, 1, 2], dtype=torch.int32)},
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
from engine.attention.selection import make_backend
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


def test_a_build_killed_mid_way_does_not_block_the_next_load(tmp_path: Path) -> None:
    # torch's cpp_extension leaves its baton file `lock` when a build is killed, and waits on
    # it for ever at the next load. A copy of this machine's build with such a file left in it:
    built = cpu_build.build_directory()
    key = built.name
    shutil.copytree(built, tmp_path / key)
    (tmp_path / key / "lock").touch()
    environment = os.environ | {"PREFIXGATE_KERNEL_CACHE": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "from engine.kernels.cpu import build; build.load()"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert not (tmp_path / key / "lock").exists()


def _attend(
    inputs: Inputs, rows: list[int], share_groups: list[int] | None, window: int = 0
) -> torch.Tensor:
    """The kernel's output for the sequences `rows` of `inputs` as one batch."""
    starts = inputs.starts.tolist()
    query = torch.cat([inputs.query[starts[r] : starts[r + 1]] for r in rows])
    lengths = [starts[r + 1] - starts[r] for r in rows]
    output = torch.empty(query.shape, dtype=query.dtype)
    paged_attention(
        output,
        query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.tables[rows].contiguous(),
        torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        inputs.contexts[rows].contiguous(),
        0.125,
        window,
        None if share_groups is None else torch.tensor(share_groups, dtype=torch.int32),
    )
    return output


def test_decodes_of_different_share_groups_never_attend_together(bf16_path: str) -> None:
    # Four decodes whose tables begin with the same 18 blocks. In groups of their own (each
    # tenant's), every one gets exactly the output it gets alone, bit for bit: nothing about
    # another tenant's requests reaches its arithmetic. In one group they share the blocks'
    # products and stay within bf16's tolerance of the reference.
    case = CASES["decode-sharing-a-prefix"]
    inputs = make_inputs(case, torch.bfloat16)
    decodes = [0, 1, 2, 3]
    apart = _attend(inputs, decodes, [0, 1, 2, 3])
    for index, row in enumerate(decodes):
        assert torch.equal(apart[index], _attend(inputs, [row], [0])[0])
    assert torch.equal(_attend(inputs, decodes, [-1, -1, -1, -1]), apart)
    assert torch.equal(_attend(inputs, decodes, None), apart)  # no groups given: none formed
    together = _attend(inputs, decodes, [5, 5, 5, 5])
    if bf16_path != "vector":  # grouped: the shared blocks' products ran, in another order
        assert not torch.equal(together, apart)
    expected = reference(inputs, case.lengths, 0)[: len(decodes)]
    torch.testing.assert_close(together.double(), expected, atol=1.6e-2, rtol=1.6e-2)
    two_groups = _attend(inputs, decodes, [7, 3, 7, 3]).double()  # two groups' states side by side
    torch.testing.assert_close(two_groups, expected, atol=1.6e-2, rtol=1.6e-2)


def test_a_prompt_chunk_rounds_as_in_one_prefill_at_any_length(matrix_path: str) -> None:
    # A prompt's last rows computed after its first blocks came from the cache (an extend of
    # 1-40 tokens) against the same rows of one 300-token prefill: bit for bit, because prompt
    # chunks take the matrix path at any length. Without the flag a short extend runs on the
    # vector kernel, which rounds otherwise.
    inputs = make_inputs(Case([(300, 300)], heads=9, kv_heads=3, head_dim=64), torch.bfloat16)

    def attend_last(tail: int, prompt: bool | None) -> torch.Tensor:
        query = inputs.query[300 - tail :]
        output = torch.empty(query.shape, dtype=query.dtype)
        flags = None if prompt is None else torch.tensor([int(prompt)], dtype=torch.int32)
        arguments = (inputs.tables, torch.tensor([0, tail], dtype=torch.int32), inputs.contexts)
        paged_attention(output, query, inputs.key_cache, inputs.value_cache, *arguments, 0.125, 0,
                        None, flags)  # fmt: skip
        return output

    whole = attend_last(300, None)
    for tail in (1, 6, 15, 40):
        assert torch.equal(attend_last(tail, True), whole[-tail:]), tail
    assert not torch.equal(attend_last(6, None), whole[-6:])
    assert not torch.equal(attend_last(6, False), whole[-6:])


def test_a_prefill_rounds_the_same_whatever_the_thread_count(matrix_path: str) -> None:
    # The matrix path gives its work items fewer rows where the batch would leave threads idle
    # (a short prompt on many threads): every row still gets the same bits, as the items'
    # products and softmax treat each row alone.
    inputs = make_inputs(Case([(100, 100), (40, 300)], heads=9, kv_heads=3, head_dim=64),
                         torch.bfloat16)  # fmt: skip
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 16):  # one thread: items of 64 tokens; 16 threads: of 16
            torch.set_num_threads(count)
            output = torch.empty(inputs.query.shape, dtype=torch.bfloat16)
            paged_attention(output, inputs.query, inputs.key_cache, inputs.value_cache,
                            inputs.tables, inputs.starts, inputs.contexts, 0.125, 0)  # fmt: skip
            outputs.append(output)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("window", [0, 275])
@pytest.mark.parametrize("block_size", [16, 8])
def test_a_decode_gets_the_same_bits_in_an_item_of_every_head(window: int, block_size: int) -> None:
    # With at least two decodes a thread, each bf16 decode's item takes every KV head of its
    # sequence, one after another; with fewer, an item per head. Each head's rows are the same
    # computation either way: the same bits, with or without a shared prefix (its first 160 keys;
    # none is shared under a window). Contexts span up to three 256-key segments, one fits in a
    # single block; a window starts mid-chunk.
    if matrix_products.DOT_PRODUCTS != "vdpbf16ps":
        pytest.skip("items of every head exist where the kernels were built with AVX512_BF16")
    contexts = [600, 300, 170, 165, 257, 512, 190, 333, 9]
    case = Case([(1, context) for context in contexts], heads=9, kv_heads=3, head_dim=64,
                block_size=block_size, window=window, num_blocks=2048 // block_size,
                shared_blocks=160 // block_size)  # fmt: skip
    inputs = make_inputs(case, torch.bfloat16)
    rows = list(range(len(contexts)))
    expected = reference(inputs, case.lengths, window)
    threads = torch.get_num_threads()
    for groups in (None, [0] * len(rows)):
        outputs = []
        try:
            for count in (1, 8):  # nine decodes on one thread: every head; on eight: one each
                torch.set_num_threads(count)
                outputs.append(_attend(inputs, rows, groups, window))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(outputs[0], outputs[1]), groups
        torch.testing.assert_close(outputs[0].double(), expected, atol=1.6e-2, rtol=1.6e-2)


def test_shared_prefix_states_past_the_kept_buffer(matrix_path: str) -> None:
    # 40 decodes over 4,096 shared keys, 4 KV heads of 8 query heads each: their pieces'
    # softmax states (1.35 M floats) are more than the calling thread keeps from call to call
    # (1 M), so they get a buffer of their own; a smaller batch after it takes the kept one.
    big = Case([(1, 4100)] * 40, heads=32, kv_heads=4, head_dim=64, num_blocks=1024,
               shared_blocks=256)  # fmt: skip
    small = Case([(1, 700)] * 6, heads=32, kv_heads=4, head_dim=64, num_blocks=1024,
                 shared_blocks=40)  # fmt: skip
    for case in (big, small, big):
        inputs = make_inputs(case, torch.bfloat16)
        rows = list(range(len(case.lengths)))
        grouped = _attend(inputs, rows, [0] * len(rows)).double()
        expected = reference(inputs, case.lengths, 0)
        torch.testing.assert_close(grouped, expected, atol=1.6e-2, rtol=1.6e-2)


def test_share_groups_must_be_one_int32_per_sequence() -> None:
    inputs = make_inputs(CASES["decode-pair-sharing-a-prefix"], torch.float32)
    with pytest.raises(RuntimeError, match="one contiguous int32 per sequence"):
        _attend(inputs, [0, 1], [0])
    arguments = _valid_arguments()
    for flags in (torch.zeros(1, dtype=torch.int32), torch.zeros(2)):
        with pytest.raises(RuntimeError, match="prompt_chunks is one contiguous int32"):
            paged_attention(*arguments.values(), None, flags)


def _pool_and_rows(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [2, blocks, block_size, kv_heads, dim] pool, and K/V rows as the engine hands them:
    read out of a fused QKV projection (strided tokens) and out of transformers' [1, heads,
    tokens, dim] layout (heads far apart)."""
    generator = torch.Generator().manual_seed(5)
    pool = torch.zeros(2, 8, 16, 3, 32, dtype=dtype)
    qkv = torch.randn(20, (6 + 3 + 3) * 32, generator=generator).to(dtype)
    fused_key = qkv[:, 192:288].view(20, 3, 32)
    transposed_value = torch.randn(1, 3, 20, 32, generator=generator).to(dtype)[0].transpose(0, 1)
    return pool, fused_key, transposed_value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_puts_each_row_where_index_copy_puts_it(dtype: torch.dtype) -> None:
    pool, key, value = _pool_and_rows(dtype)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(6))[:20]
    expected = pool.clone()
    expected[0].view(-1, 3, 32).index_copy_(0, slots, key)
    expected[1].view(-1, 3, 32).index_copy_(0, slots, value)
    torch.ops.prefixgate.write_kv(pool[0], pool[1], key, value, slots)
    assert torch.equal(pool, expected)
    assert pool.count_nonzero() > 0  # something was written
    torch.ops.prefixgate.write_kv(pool[0], pool[1], key[:0], value[:0], slots[:0])  # no tokens
    assert torch.equal(pool, expected)


def test_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing() -> None:
    pool, key, value = _pool_and_rows(torch.float32)
    for bad in (8 * 16, -1):
        slots = torch.arange(20)
        slots[-1] = bad
        with pytest.raises(RuntimeError, match=f"slot {bad} is outside the pool"):
            torch.ops.prefixgate.write_kv(pool[0], pool[1], key, value, slots)
        assert pool.count_nonzero() == 0
    slots = torch.arange(20)
    with pytest.raises(RuntimeError, match="in the caches' dtype, dim contiguous"):
        torch.ops.prefixgate.write_kv(pool[0], pool[1], key.double(), value, slots)
    strided = torch.zeros(20, 3, 64)[..., ::2]  # each head's dim every other element
    with pytest.raises(RuntimeError, match="in the caches' dtype, dim contiguous"):
        torch.ops.prefixgate.write_kv(pool[0], pool[1], strided, value, slots)
    with pytest.raises(RuntimeError, match="one row per token"):
        torch.ops.prefixgate.write_kv(pool[0], pool[1], key, value[:19], slots)
    with pytest.raises(RuntimeError, match="caches must be contiguous"):
        torch.ops.prefixgate.write_kv(pool[0][:, ::2], pool[1][:, ::2], key, value, slots)
    assert pool.count_nonzero() == 0
    with pytest.raises(RuntimeError, match="one contiguous int64 per token"):
        torch.ops.prefixgate.write_kv(pool[0], pool[1], key, value, torch.arange(20).int())


def test_a_built_kernel_loads_where_no_lock_can_be_taken(tmp_path: Path) -> None:
    # An image's kernel cache under a read-only root: the build is there, `.lock` cannot be
    # opened for writing (here a directory stands in its way, which stops root too). Before,
    # the engine fell back to the torch backend, half as fast.
    built = cpu_build.build_directory()
    shutil.copytree(built, tmp_path / built.name)
    (tmp_path / built.name / ".lock").unlink(missing_ok=True)
    (tmp_path / built.name / ".lock").mkdir()
    environment = os.environ | {"PREFIXGATE_KERNEL_CACHE": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "from engine.kernels.cpu import build; build.load(); "
         "import torch; print(hasattr(torch.ops.prefixgate, 'paged_attention'))"],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "True"
    # Without the build, the same refusal as any failed build: one line, no traceback.
    shutil.rmtree(tmp_path / built.name)
    (tmp_path / built.name / ".lock").mkdir(parents=True)
    failed = subprocess.run(
        [sys.executable, "-c", "from engine.kernels.cpu import build; build.load()"],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert failed.returncode != 0
    assert "KernelUnavailable: cannot build the CPU kernels" in failed.stderr
