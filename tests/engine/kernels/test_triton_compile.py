"""The Triton kernels compile for NVIDIA GPUs here, without one: Triton's own compiler and its
bundled ptxas need no driver. The interpreter runs the kernels' arithmetic; this catches what
only the compiler refuses (types merged across branches, `tl.dot` shapes, constexprs, shared
memory), for Hopper (sm_90: H100, H200) and Ampere (sm_80: A100), in bf16 and fp32, with
32-bit and 64-bit strides (a GPU pool passes 2**31 elements)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.triton import decode as triton_decode
from engine.kernels.triton import kv_write as triton_kv_write
from engine.kernels.triton import prefill as triton_prefill
from engine.kernels.triton import zero as triton_zero

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "sm80": GPUTarget("cuda", 80, 32)}
INDEX_POINTERS = {
    "block_tables_ptr": "*i32",
    "query_starts_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "block_ids_ptr": "*i64",
}
ATTENTION = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "WIDEN": False}
# kernel, its constexprs (PRECISION is added per dtype)
KERNELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "decode": (triton_decode._decode_kernel, ATTENTION | {
        "GROUP": 4, "BLOCK_H": 16, "BLOCK_N": 64, "SPLIT": False, "HEADS": 32}),
    "decode-split": (triton_decode._decode_kernel, ATTENTION | {
        "GROUP": 3, "BLOCK_H": 16, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_N": 64,
        "SPLIT": True, "HEADS": 9}),
    "merge": (triton_decode._merge_splits_kernel, {
        "HEADS": 32, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 64}),
    "prefill": (triton_prefill._prefill_kernel, ATTENTION | {
        "GROUP": 4, "BLOCK_M": 64, "BLOCK_N": 64}),
    "prefill-head-80": (triton_prefill._prefill_kernel, ATTENTION | {
        "GROUP": 1, "HEAD_DIM": 80, "BLOCK_D": 128, "BLOCK_SIZE": 32, "BLOCK_M": 64,
        "BLOCK_N": 64}),
    # fp32 heads of 256: 32-key tiles (`key_tile`), to fit an A100's shared memory.
    "prefill-head-256": (triton_prefill._prefill_kernel, ATTENTION | {
        "GROUP": 2, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_M": 64, "BLOCK_N": 32}),
    "decode-head-256": (triton_decode._decode_kernel, ATTENTION | {
        "GROUP": 2, "BLOCK_H": 16, "HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_N": 32,
        "SPLIT": True, "HEADS": 8}),
    "kv-write": (triton_kv_write._write_kv_kernel, {
        "KV_HEADS": 3, "HEAD_DIM": 64, "BLOCK_H": 4, "BLOCK_D": 64, "BLOCK_SIZE": 16}),
    "zero": (triton_zero._zero_blocks_kernel, {"BLOCK_ELEMENTS": 16384, "RUN": 8192}),
}  # fmt: skip


def source(kernel: Any, constants: dict[str, Any], dtype: str, wide_strides: bool) -> ASTSource:
    signature: dict[str, str] = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in INDEX_POINTERS:
            signature[name] = INDEX_POINTERS[name]
        elif name.startswith("part_"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if wide_strides and name.startswith("stride_") else "i32"
    constants = constants | {"PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    names = list(signature)
    constexprs = {(names.index(name),): value for name, value in constants.items() if name in names}
    assert len(constexprs) == sum(param.is_constexpr for param in kernel.params)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs)


# The main kernels for Hopper in both dtypes and with 64-bit strides; the attention kernels for
# Ampere, fp32 heads of 256 included (2-3 s a compile on 2 cores).
MAIN = ("decode", "decode-split", "merge", "prefill", "kv-write", "zero")
CONFIGS = [
    *((name, "sm90", dtype, False) for name in MAIN for dtype in ("bf16", "fp32")),
    *((name, "sm90", "bf16", True) for name in ("decode", "prefill", "kv-write", "zero")),
    *((name, "sm80", "bf16", False) for name in ("decode-split", "prefill", "prefill-head-80")),
    *((name, "sm80", "fp32", False) for name in ("decode-head-256", "prefill-head-256")),
]


def compile_all() -> None:
    """Compile every config and print one JSON object: config -> shared bytes or the error.
    Run in a process of its own: the test process defines the kernels for the interpreter."""
    results: dict[str, Any] = {}
    for name, target, dtype, wide in CONFIGS:
        kernel, constants = KERNELS[name]
        try:
            compiled = triton.compile(
                source(kernel, constants, dtype, wide), target=TARGETS[target]
            )
            assert compiled.asm["cubin"], "no machine code"
            results[str((name, target, dtype, wide))] = compiled.metadata.shared
        except Exception as error:
            results[str((name, target, dtype, wide))] = f"{type(error).__name__}: {error}"[:2000]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", f"from {__name__} import compile_all; compile_all()"],
        env=environment | {"TRITON_DEFAULT_FP_FUSION": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    results: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize(
    ("name", "target", "dtype", "wide"),
    CONFIGS,
    ids=["-".join([n, t, d, "i64" if w else "i32"]) for n, t, d, w in CONFIGS],
)
def test_kernel_compiles_for_the_gpu(
    compiled: dict[str, Any], name: str, target: str, dtype: str, wide: bool
) -> None:
    shared = compiled[str((name, target, dtype, wide))]
    assert isinstance(shared, int), shared  # else the compiler's error
    assert shared <= 160 * 1024  # fits an A100's (and an H100's) shared memory
