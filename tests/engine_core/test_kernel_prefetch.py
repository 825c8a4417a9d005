"""The attention kernels' software prefetches survive compilation.

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

from engine.kernels import KernelUnavailable, cpu_build
from engine.precision import cpu_flags

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("objdump") is None,
    reason="reads x86 objects with objdump",
)


@pytest.mark.parametrize("source", ["paged_attention", "paged_attention_matrix"])
def test_the_built_attention_kernels_keep_their_prefetches(source: str) -> None:
    try:
        cpu_build.load()
    except KernelUnavailable as error:
        pytest.skip(str(error))
    if source == "paged_attention_matrix" and "avx512bw" not in cpu_flags():
        pytest.skip("the matrix path's packing prefetches in its AVX-512 loop only")
    listing = subprocess.run(
        ["objdump", "-d", str(cpu_build.build_directory() / f"{source}.o")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert listing.count("prefetcht1") >= 2, f"{source}.o lost its prefetches"
