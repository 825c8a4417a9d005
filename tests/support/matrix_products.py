"""Which bf16 matrix products the CPU kernels take in a test: oneDNN's AMX micro-kernels
("amx"), `bf16_product.h`'s own loops ("dot": vdpbf16ps with AVX512_BF16, fp32 FMA with AVX2),
or for the attention none ("vector": its vector kernel), each where this CPU has it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels.cpu import build as cpu_build

cpu_build.load()
# What the kernels take by default here: "amx", "vdpbf16ps", "fma" or "off"; and which loops
# run here where AMX is not taken ("vdpbf16ps", "fma", or "off": none; on a CPU with AMX they
# are taken only when AMX is switched off).
DEFAULT = torch.ops.prefixgate.use_matrix_units(True, True)
DOT_PRODUCTS = torch.ops.prefixgate.use_matrix_units(True, False)
torch.ops.prefixgate.use_matrix_units(True, True)


def take(path: str) -> Iterator[str]:
    """Run the test on `path` ("vector", "amx" or "dot"), skipped where this CPU lacks it; the
    default again afterwards."""
    if path == "amx" and DEFAULT != "amx":
        pytest.skip("no AMX products here (no AMX, or oneDNN's micro-kernels off)")
    if path == "dot" and DOT_PRODUCTS == "off":
        pytest.skip("the kernels were built with neither AVX512_BF16 nor AVX2 without AVX-512")
    taken = torch.ops.prefixgate.use_matrix_units(path != "vector", path == "amx")
    assert taken == {"vector": "off", "amx": "amx", "dot": DOT_PRODUCTS}[path]
    yield path
    torch.ops.prefixgate.use_matrix_units(True, True)
