"""Linear layers on the CPU: bf16 ones on PrefixGate's own kernel where the CPU has bf16
matrix products (AMX, AVX512_BF16, or AVX2 without AVX-512), fp32 ones on it where the CPU has
AVX2 without AVX-512, the rest on whichever of two torch paths measured faster here for the row
count.

**bf16 with AMX, AVX512_BF16 or AVX2: `MatrixLinear`** (`matrix_linear.cpp`). Every output is one
micro-kernel product over all input features, in one order, whatever the call's row count and
thread count, so a token's projections are the same bits alone, in a prefill of thousands of
tokens, or beside other tenants' tokens in a step. oneDNN's matmul and torch's `linear` are not
(measured on a Xeon with AMX: torch's `linear` gave other bits for a row at 2-32 and 512-1,024
rows than in a 1,536-row call; oneDNN's packed matmul, for the 1,536-input down projection, at
130-300 rows than alone), which made a request's greedy tokens depend at near-ties on what
shared its steps, and on whether its prefix came from the cache. No timing decides anything
here, so two processes on one machine compute the same bits. Against the torch paths below it
measured faster at few rows, as fast at hundreds and somewhat slower at the most (figures:
docs/performance.md).

**fp32 with AVX2 (no AVX-512): `MatrixLinear` too** (`fp32_product.h`): FMA chains in one
order, as above, so an fp32 model's projections are the same bits at any row count as well;
it measured faster than both `PackedLinear` and torch's plain `linear` at every row count.

**Everything else: `PackedLinear`.** torch's plain `linear` hands the weight over row-major on
every call; oneDNN can instead read a copy packed once in its own blocked layout. Which is
faster depends on the CPU and on how many rows a call has, and not a little: on one CPU packed
was faster everywhere, on another much slower at one row and faster at 16.

So `pack_linears` measures, at start, both paths for each weight shape of the model at 1, 16,
64 and 1,024 rows, interleaved, and each `PackedLinear` takes, per call, the path that won for
its row class. A weight of more than `LARGE_ROWS_MAX_WEIGHT` elements (an LM head, which
seldom sees more than one row per sequence) is not timed at 1,024 rows, which would take long;
it keeps its 64-row choice there. A shape whose packed path never wins keeps no packed copy.
Results are equal up to summation order either way; which path a row count takes varies with
the machine's load at start, so these layers' bits can differ between processes and between
row counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from engine import huge_pages
from engine.kernels import KernelUnavailable
from engine.kernels.cpu import build as cpu_build
from engine.math_utils import cdiv

# Row classes a call falls into (up to each bound; the last is open), and the row count each
# is measured at.
ROW_BOUNDS = (1, 32, 256)
MEASURED_ROWS = (1, 16, 64, 1024)
LARGE_ROWS_MAX_WEIGHT = 16 << 20
# The packed path must win by this factor to be taken: a near-tie is noise, and the plain path
# costs no second copy of the weight.
MARGIN = 0.9
_ROUNDS, _REPEATS = 2, 2
# What matrix_linear.cpp says where it has no products for a dtype: for bf16 no AMX (or oneDNN
# off in torch) and the kernels built with neither AVX512_BF16 nor AVX2 and FMA (without
# AVX-512); for fp32 the kernels built without AVX2 and FMA, or with AVX-512.
NO_PRODUCTS = (
    "this CPU has no bf16 matrix micro-kernels",
    "this build has no fp32 matrix products",
)


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """For each row class (1 row, up to 32, up to 256, more), whether the packed path is
    faster."""

    packed: tuple[bool, bool, bool, bool]

    def packed_for(self, rows: int) -> bool:
        for index, bound in enumerate(ROW_BOUNDS):
            if rows <= bound:
                return self.packed[index]
        return self.packed[-1]


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` that runs each call on the path its `LinearPlan` chose for the call's row
    count: torch's `linear`, or oneDNN with the weight packed once.

    The original `weight` stays a parameter (same tensor, no copy), so `state_dict` and
    copies of the model see the model they loaded.
    """

    def __init__(self, linear: torch.nn.Linear, plan: LinearPlan) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.plan = plan
        self.packed: torch.Tensor | None = None
        if any(plan.packed):
            with torch.no_grad():
                self.packed = _pack(linear.weight.detach())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, self.in_features)
        if self.packed is not None and self.plan.packed_for(rows.shape[0]):
            output: torch.Tensor = _packed_linear(rows, self.packed, self.bias)
        else:
            output = F.linear(rows, self.weight, self.bias)
        return output.reshape(*inputs.shape[:-1], self.out_features)


class MatrixLinear(torch.nn.Module):
    """A bf16 or fp32 `nn.Linear` on `matrix_linear.cpp`: one order of arithmetic for every row
    count and thread count. `fp32_out`: a bf16 layer's sums are returned in fp32, not rounded
    to bf16 (an LM head's logits, see `engine.kernels.cpu.logits`); an fp32 layer's always are.

    The weight is packed once, here: a second copy, in the micro-kernel's layout (the model's
    weights are frozen while it serves). The original `weight` stays a parameter, so
    `state_dict` and tied embeddings see the model they loaded (the copy is not refreshed if
    the weight changes). Raises `KernelUnavailable` or `RuntimeError` where the kernels or the
    CPU's products for the weight's dtype are missing.
    """

    def __init__(self, linear: torch.nn.Linear, fp32_out: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.fp32_out = fp32_out or linear.weight.dtype == torch.float32
        cpu_build.load()
        with torch.no_grad():
            self.packed = torch.ops.prefixgate.pack_matrix_weight(linear.weight.detach())
            self.bias_fp32 = None if linear.bias is None else linear.bias.detach().float()
        self.gathered = False  # moved into huge pages by `gather_packed_weights`

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self._product(inputs, self.fp32_out, gated=False)

    def gated_silu(self, inputs: torch.Tensor) -> torch.Tensor:
        """For a fused gate-and-up projection ([gate; up] outputs, halves a multiple of 64
        wide): `gated_silu(self(inputs))` in one pass, the same bits, without writing the
        product out and reading it back."""
        return self._product(inputs, fp32_out=False, gated=True)

    def _product(self, inputs: torch.Tensor, fp32_out: bool, gated: bool) -> torch.Tensor:
        if inputs.dim() == 2 and inputs.is_contiguous():  # rows already (the decoder's)
            return self.rows(inputs, fp32_out, gated)
        rows = inputs.reshape(-1, self.in_features).contiguous()
        output = self.rows(rows, fp32_out, gated)
        return output.reshape(*inputs.shape[:-1], output.shape[-1])

    def rows(self, rows: torch.Tensor, fp32_out: bool, gated: bool = False) -> torch.Tensor:
        """The product of a contiguous [rows, in_features] input, the kernel called directly
        (`LlamaDecoder` calls this instead of the module: cpu_decoder.project says why)."""
        output: torch.Tensor = torch.ops.prefixgate.matrix_linear(
            rows, self.packed, self.bias_fp32, self.out_features, fp32_out, gated
        )
        return output


def matrix_linear(linear: torch.nn.Linear, fp32_out: bool = False) -> MatrixLinear | None:
    """`linear` as a `MatrixLinear`, or None where it cannot be one: neither bf16 nor fp32 on
    the CPU, a bf16 one with an odd number of inputs, no kernel build, or no products for its
    dtype on this CPU."""
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if weight.dtype == torch.bfloat16 and linear.in_features % 2:
        return None
    try:
        return MatrixLinear(linear, fp32_out)
    except KernelUnavailable:
        return None
    except RuntimeError as error:  # anything else (memory, say) is not this CPU's lack
        if not any(reason in str(error) for reason in NO_PRODUCTS):
            raise
        return None


def gather_packed_weights(model: torch.nn.Module) -> None:
    """Move the packed weights of `model`'s `MatrixLinear`s into one buffer in 2 MB pages
    (`engine.huge_pages`: each decode step reads them all from memory), in module order, one
    at a time, so that memory holds each weight about once while they move, then give their
    old memory back to the system. Layers already moved (a runner made again for the same
    model) stay where they are."""
    linears = [
        module
        for module in model.modules()
        if isinstance(module, MatrixLinear) and not module.gathered
    ]
    if not linears:
        return
    sizes = [module.packed.numel() * module.packed.element_size() for module in linears]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + cdiv(size, 64) * 64)  # each weight 64-byte aligned
    arena = huge_pages.empty((starts[-1],), torch.uint8)
    for module, start, size in zip(linears, starts, sizes, strict=False):
        packed = module.packed
        moved = arena[start : start + size].view(packed.dtype).view(packed.shape)
        moved.copy_(packed)
        module.packed = moved
        module.gathered = True
    huge_pages.trim_heap()  # the packed weights' old memory, freed above


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # Packed for one row at a time: measured no slower than a layout for more rows.
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return packed


def _packed_linear(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    output: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return output


def measure_plan(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearPlan:
    """Time both paths for a weight at each of `rows_to_time(weight)`, interleaved so that the
    machine's drift hits both alike; the packed path wins a class if its best time is under
    `MARGIN` times the plain one's."""
    with torch.inference_mode():
        packed = _pack(weight.detach())
        wins: list[bool] = []
        for rows in rows_to_time(weight):
            inputs = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            plain = partial(F.linear, inputs, weight, bias)
            oned = partial(_packed_linear, inputs, packed, bias)
            times = [(_best_time(plain), _best_time(oned)) for _ in range(_ROUNDS)]
            wins.append(min(t[1] for t in times) < MARGIN * min(t[0] for t in times))
    wins += wins[-1:] * (len(MEASURED_ROWS) - len(wins))  # a class not timed: the last choice
    return LinearPlan((wins[0], wins[1], wins[2], wins[3]))


def rows_to_time(weight: torch.Tensor) -> tuple[int, ...]:
    """The row counts `measure_plan` times for `weight`: all of `MEASURED_ROWS`, but not 1,024
    for a weight of more than `LARGE_ROWS_MAX_WEIGHT` elements."""
    if weight.numel() > LARGE_ROWS_MAX_WEIGHT:
        return MEASURED_ROWS[:-1]
    return MEASURED_ROWS


def _best_time(call: Callable[[], torch.Tensor]) -> float:
    call()  # warm: first calls allocate and, for oneDNN, create the primitive
    best = float("inf")
    for _ in range(_REPEATS):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def pack_linears(
    model: torch.nn.Module, matrix_kernel: bool = True
) -> dict[tuple[int, int], LinearPlan]:
    """Swap every bf16 CPU `nn.Linear` of `model` for a `MatrixLinear` where the CPU has bf16
    matrix products (AMX, AVX512_BF16, AVX2), every fp32 one where it has fp32 ones (AVX2
    without AVX-512), and every other fp32 or bf16 one for a `PackedLinear` on a plan measured
    once per weight shape; returns the plans by (out, in) features. A layer stays as it was
    without oneDNN, on other devices, or in bf16 where oneDNN has no bf16 support.
    `matrix_kernel` False: no `MatrixLinear` at all (torch's paths alone, to compare with)."""
    if matrix_kernel:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear and (swapped := matrix_linear(child)) is not None:
                    setattr(parent, name, swapped)
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return {}
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.dtype in dtypes
        and child.weight.device.type == "cpu"
    ]
    plans: dict[tuple[int, int], LinearPlan] = {}
    for parent, name, child in targets:
        shape = (child.out_features, child.in_features)
        if shape not in plans:
            plans[shape] = measure_plan(child.weight, child.bias)
        setattr(parent, name, PackedLinear(child, plans[shape]))
    return plans
