"""Which bf16 matrix products the CPU kernels take in a test: oneDNN's AMX micro-kernels
("amx"), `bf16_product.h`'s vdpbf16ps loops ("vdpbf16ps", AVX512_BF16), or for the attention
none ("vector": its vector kernel), each where this CPU has it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels import cpu_build

cpu_build.load()
# What the kernels take by default here: "amx", "vdpbf16ps" or "off"; and whether the
# vdpbf16ps loops run here (on a CPU with AMX they are taken only when AMX is switched off).
DEFAULT = torch.ops.prefixgate.use_matrix_units(True, True)
DOT_PRODUCTS = torch.ops.prefixgate.use_matrix_units(True, False) == "vdpbf16ps"
torch.ops.prefixgate.use_matrix_units(True, True)


def take(path: str) -> Iterator[str]:
    """Run the test on `path` ("vector", "amx" or "vdpbf16ps"), skipped where this CPU lacks
    it; the default again afterwards."""
    if path == "amx" and DEFAULT != "amx":
        pytest.skip("no AMX products here (no AMX, or oneDNN's micro-kernels off)")
    if path == "vdpbf16ps" and not DOT_PRODUCTS:
        pytest.skip("the kernels were not built with AVX512_BF16")
    taken = torch.ops.prefixgate.use_matrix_units(path != "vector", path == "amx")
    assert taken == ("off" if path == "vector" else path)
    yield path
    torch.ops.prefixgate.use_matrix_units(True, True)
