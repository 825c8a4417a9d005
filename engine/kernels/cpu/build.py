"""Building and loading the C++ CPU kernels (`paged_attention.cpp`,
`paged_attention_matrix.cpp`, `matrix_linear.cpp`, `elementwise.cpp`, `logits_rows.cpp` and
`kv_write.cpp`, with their headers).

The extension is compiled with `torch.utils.cpp_extension` for the CPU it runs on
(`-march=native`; its threads are torch's own pool; tuning constants measured per CPU,
`compile_flags`) into a directory keyed by the sources, torch's version, the CPU's flags and
those constants, so a second start only loads it.
`make run` / `make test` build it at install time (`python -m engine.kernels.cpu.build`); a
start that finds no build compiles it then, once, under a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import os
import platform
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import torch

from engine.kernels import KernelUnavailable
from engine.precision import cpu_flags, cpu_info, flags_of

SOURCES = (
    "paged_attention.cpp",
    "paged_attention_matrix.cpp",
    "matrix_linear.cpp",
    "elementwise.cpp",
    "logits_rows.cpp",
    "kv_write.cpp",
)
HEADERS = (
    "bf16_product.h",
    "fp32_product.h",
    "cpu_vector.h",
    "paged_attention_matrix.h",
    "work_items.h",
)
# -fopenmp: at::parallel_for is inline and runs its threads with `omp parallel` in this file.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]


def prefetch_ahead(info: Mapping[str, str]) -> int:
    """How far ahead, in runs of 16 key positions, the attention kernels prefetch K/V
    (`kAhead` in paged_attention.cpp) on the CPU /proc/cpuinfo describes: the distance measured
    best there. Two on an AMD EPYC of CPU family 25 with AVX-512 (Zen 4), where it measured
    faster than four; elsewhere four, which measured faster than two on a Zen 5 (family 26)
    (Intel Xeons were not measured against two)."""
    zen4 = (
        info.get("vendor_id") == "AuthenticAMD"
        and info.get("cpu family") == "25"
        and "avx512f" in flags_of(info)
    )
    return 2 if zen4 else 4


def compile_flags() -> list[str]:
    """FLAGS and this CPU's choices among the kernels' tuning constants."""
    return [*FLAGS, f"-DPREFIXGATE_PREFETCH_AHEAD={prefetch_ahead(cpu_info())}"]


_failures: list[KernelUnavailable] = []  # the first failure, raised again by later calls


def kernels_dir() -> Path:
    """$PREFIXGATE_KERNEL_CACHE, else ~/.cache/prefixgate/kernels."""
    configured = os.environ.get("PREFIXGATE_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "prefixgate" / "kernels"


def source_file(name: str) -> Path:
    """A kernel source or header, where the installed package keeps it."""
    return Path(str(importlib.resources.files("engine.kernels.cpu") / name))


def _build_key() -> str:
    hasher = hashlib.sha256()
    for name in SOURCES + HEADERS:
        hasher.update(name.encode() + b"\0" + source_file(name).read_bytes())
    for part in (torch.__version__, sys.version, platform.machine(), " ".join(compile_flags())):
        hasher.update(b"\0" + part.encode())
    hasher.update(b"\0" + " ".join(sorted(cpu_flags())).encode())
    return hasher.hexdigest()[:16]


def build_directory() -> Path:
    """Where this source's build for this machine lives (or will)."""
    return kernels_dir() / _build_key()


@cache
def load() -> None:
    """Load the kernels into this process (they register `torch.ops.prefixgate.*`), building
    them first if this machine has no build yet. A failure is remembered: the next call raises
    it again at once instead of compiling again."""
    if _failures:
        raise _failures[0]
    # The ninja that pip installed lives beside this interpreter, which may not be on PATH.
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    directory = build_directory()
    try:
        try:
            _load_locked(directory)
        except OSError:
            built = directory / f"prefixgate_cpu_{directory.name}.so"
            if not built.is_file():
                raise
            # A read-only cache (an image's, under a read-only root) that holds this build: no
            # lock can be taken there, and none is needed to load it.
            torch.ops.load_library(str(built))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError, ImportError) as error:
        # The compiler's whole output stays in the chained exception; the message is its gist.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        failure = KernelUnavailable(f"cannot build the CPU kernels: {first_line}")
        _failures.append(failure)
        raise failure from error


def _load_locked(directory: Path) -> None:
    """Build this source for this machine unless it is built, and load it, under the build
    directory's lock."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # torch's own baton file: with our lock held no other build of this key runs, so
            # one left here is from a build that was killed, and torch would wait on it for
            # ever.
            (directory / "lock").unlink(missing_ok=True)
            _build_and_load(directory)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_and_load(directory: Path) -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=f"prefixgate_cpu_{directory.name}",
        sources=[str(source_file(name)) for name in SOURCES],
        extra_cflags=compile_flags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def main() -> None:
    """Build the kernels now (the install step), or say why not and exit 0: serving falls back
    to the torch backend."""
    try:
        load()
    except KernelUnavailable as error:
        print(f"warning: {error}; the torch attention backend will be used", file=sys.stderr)
        return
    print(f"CPU kernels built in {kernels_dir()}", file=sys.stderr)


if __name__ == "__main__":
    main()
