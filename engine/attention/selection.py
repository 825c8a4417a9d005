"""Which attention backend serves: by name, or `auto` for the best one that works here.

`auto` picks triton on a CUDA device; on a CPU the C++ kernel (`cpu`) where it builds and fits
the model's head size, else the reference `torch` backend. A backend named explicitly that
cannot serve here is refused with a `ValueError` saying why, never replaced.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.cpu_backend import CpuAttention
from engine.attention.paged import AttentionBackend
from engine.attention.torch_backend import TorchAttention
from engine.attention.triton_backend import TritonAttention
from engine.kernels import KernelUnavailable

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "torch", "triton")


def make_backend(name: str, device: torch.device, head_dim: int) -> AttentionBackend:
    """An attention backend by name. `auto`: triton on a CUDA device; on a CPU the C++ kernel
    where it builds and fits the model (head_dim a multiple of 16), else torch. A backend
    named explicitly that cannot serve here is a `ValueError` saying why."""
    _check_name(name)
    if name == "torch":
        return TorchAttention()
    try:
        if name == "triton" or (name == "auto" and device.type == "cuda"):
            return TritonAttention.create(device)
        return CpuAttention.create(device, head_dim)
    except KernelUnavailable as error:
        if name != "auto":
            raise _unavailable(name, error) from error
        logger.warning("attention backend: torch (%s)", error)
        return TorchAttention()


def check_backend(name: str, device: torch.device) -> None:
    """Refuse, before a model loads, a backend named explicitly that cannot run on `device`
    (ValueError saying why); head-size limits are checked once the model is known."""
    _check_name(name)
    try:
        if name == "cpu":
            CpuAttention.check(device)
        elif name == "triton":
            TritonAttention.check(device)
    except KernelUnavailable as error:
        raise _unavailable(name, error) from error


def _check_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; have {', '.join(BACKEND_NAMES)}")


def _unavailable(name: str, error: KernelUnavailable) -> ValueError:
    return ValueError(f"attention backend {name!r} is unavailable: {error}")
