"""Where the model computes (`resolve_device`) and in which dtype (`resolve_dtype`).

`auto` is bf16 where the CPU computes bf16 natively (AVX512_BF16 or AMX-BF16: a higher rate
than fp32's for the same weights, half the memory traffic) or on a CUDA device that supports
it, and fp32 elsewhere. A setting overrides it. On a CPU with AVX2 but no AVX-512, a forced
bf16 runs on the kernels' FMA loops (`bf16_product.h`): prefill as fast as fp32, decode
faster (half the bytes to read), at bf16's rounding; `auto` leaves that choice to the
operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType

import torch

DTYPE_SETTINGS = ("auto", "bfloat16", "float32")
DEVICE_SETTINGS = ("auto", "cpu", "cuda")
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@cache
def cpu_info() -> Mapping[str, str]:
    """This machine's /proc/cpuinfo as `parse_cpuinfo` reads it (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return MappingProxyType({})
    return MappingProxyType(parse_cpuinfo(text))


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first CPU's fields of a /proc/cpuinfo text ("vendor_id", "cpu family", "model name",
    "flags"...), stripped. Where that block has no "flags" or "Features" (32-bit ARM kernels
    list "Features" once, after every CPU's block), the first such line anywhere."""
    info: dict[str, str] = {}
    fields = [line.partition(":") for line in text.splitlines()]
    for name, separator, value in fields:
        if not separator:
            if info and not name.strip():
                break  # the blank line after the first CPU's fields
            continue
        info[name.strip()] = value.strip()
    if "flags" not in info and "Features" not in info:
        for name, separator, value in fields:
            if separator and name.strip() in ("flags", "Features"):
                info[name.strip()] = value.strip()
                break
    return info


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return flags_of(cpu_info())


def flags_of(info: Mapping[str, str]) -> frozenset[str]:
    """The feature flags of a CPU's /proc/cpuinfo fields: "flags" on x86, "Features" on ARM."""
    return frozenset(info.get("flags", info.get("Features", "")).split())


def native_bf16_flags() -> list[str]:
    """The CPU flags that make bf16 native here (empty: none)."""
    return sorted(_NATIVE_BF16_FLAGS & cpu_flags())


def resolve_dtype(setting: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype for `setting` (auto, bfloat16 or float32) on `device`."""
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "float32":
        return torch.float32
    if setting != "auto":
        raise ValueError(f"unknown dtype {setting!r}; use one of {', '.join(DTYPE_SETTINGS)}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if native_bf16_flags() else torch.float32


def resolve_device(setting: str) -> torch.device:
    """The device for `setting`: auto is the first CUDA GPU if there is one, else the CPU;
    cuda where there is none is a ValueError."""
    if setting not in DEVICE_SETTINGS:
        raise ValueError(f"unknown device {setting!r}; use one of {', '.join(DEVICE_SETTINGS)}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA GPU is visible to torch here")
    return torch.device("cuda", torch.cuda.current_device())
