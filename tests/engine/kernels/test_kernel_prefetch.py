"""The kernels' software prefetches survive compilation.

GCC deletes a loop whose body has no side effects, and it counts `__builtin_prefetch` as none:
every prefetch loop of the kernels was once gone from the binary, and decode attention from
memory ran at half its speed with nobody the wiser. They go through `prefetch_l2`
(cpu_vector.h), an asm statement; this checks the built objects still hold its instruction.
"""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from engine.kernels import KernelUnavailable
from engine.kernels.cpu import build as cpu_build
from engine.precision import cpu_flags

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("objdump") is None,
    reason="reads x86 objects with objdump",
)


@pytest.mark.parametrize("source", ["paged_attention", "paged_attention_matrix", "matrix_linear"])
def test_the_built_kernels_keep_their_prefetches(source: str) -> None:
    try:
        cpu_build.load()
    except KernelUnavailable as error:
        pytest.skip(str(error))
    if source == "paged_attention_matrix" and "avx512bw" not in cpu_flags():
        pytest.skip("the matrix path's packing prefetches in its AVX-512 loop only")
    if source == "matrix_linear" and "avx512_bf16" not in cpu_flags():
        pytest.skip("the linear layers fetch their next tile in the vdpbf16ps loops only")
    listing = subprocess.run(
        ["objdump", "-d", str(cpu_build.build_directory() / f"{source}.o")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert listing.count("prefetcht1") >= 2, f"{source}.o lost its prefetches"


ZEN4 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu avx2 avx512f avx512_bf16"}


def test_the_prefetch_distance_is_the_one_measured_best_on_the_cpu() -> None:
    assert cpu_build.prefetch_ahead(ZEN4) == 2
    zen3 = {**ZEN4, "flags": "fpu avx2"}  # family 25 without AVX-512: not measured, the default
    zen5 = {**ZEN4, "cpu family": "26"}
    xeon = {**ZEN4, "vendor_id": "GenuineIntel", "cpu family": "6"}
    assert [cpu_build.prefetch_ahead(info) for info in (zen3, zen5, xeon, {})] == [4, 4, 4, 4]


def test_a_build_for_another_prefetch_distance_is_another_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_build, "cpu_info", lambda: ZEN4)
    assert "-DPREFIXGATE_PREFETCH_AHEAD=2" in cpu_build.compile_flags()
    zen4_build = cpu_build.build_directory()
    monkeypatch.setattr(cpu_build, "cpu_info", lambda: {**ZEN4, "cpu family": "26"})
    assert "-DPREFIXGATE_PREFETCH_AHEAD=4" in cpu_build.compile_flags()
    assert cpu_build.build_directory() != zen4_build
