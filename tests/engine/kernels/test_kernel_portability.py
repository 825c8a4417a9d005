"""The C++ kernels compile for CPUs other than this one.

`make run` builds them with `-march=native`, so the code paths this machine lacks the
instructions for (no AVX at all, AVX2 only, AVX-512 without BF16, AVX512_BF16 without AMX)
are compiled nowhere else. Each source is checked here (`-fsyntax-only`, the build's own flags
otherwise) for four x86 targets; a name used outside the `#if` that defines it fails here, not
on a user's machine.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from engine.kernels.cpu import build as cpu_build

# x86-64: SSE2 only (the vectors' plain C++ fallbacks). x86-64-v3: AVX2 and FMA, no AVX-512.
# skylake-avx512: AVX-512 (F, BW, VL), no BF16, no AMX. cooperlake: AVX512_BF16, no AMX.
TARGETS = ("x86-64", "x86-64-v3", "skylake-avx512", "cooperlake")
COMPILER = os.environ.get("CXX", "c++")

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which(COMPILER) is None,
    reason="checks x86 targets with the build's C++ compiler",
)


def test_every_kernel_source_compiles_for_other_x86_cpus() -> None:
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    flags = [flag for flag in cpu_build.FLAGS if not flag.startswith("-march=")]
    jobs = {}
    for target in TARGETS:
        for name in cpu_build.SOURCES:
            command = [COMPILER, "-std=c++20", "-fsyntax-only", f"-march={target}", *flags]
            command += [argument for path in includes for argument in ("-isystem", path)]
            command.append(str(cpu_build.source_file(name)))
            jobs[(target, name)] = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
    failures = []
    for (target, name), job in jobs.items():
        output, _ = job.communicate(timeout=300)
        if job.returncode != 0:
            errors = [line for line in output.splitlines() if "error" in line]
            failures.append(f"{name} for {target}: {errors[:3]}")
    assert not failures, failures
