"""CPU memory backed by 2 MB pages where Linux gives them (transparent huge pages).

Every decode step reads all of the model's weights and its sequences' K/V from memory: about
270 MB of packed bf16 weights and, for 16 streams over 1,544-token contexts, 190 MB of K/V.
In 4 KB pages that is some 115,000 pages a step, far more than the TLB holds, so nearly every
page costs a page walk, and the hardware prefetchers stop at each page's end. In 2 MB pages it
is a few hundred. On a Zen 5 EPYC (2 vCPUs, 2026-12-04; side by side in one process), SmolLM2's
30 layers of projections took 0.91x the time at one row and 0.92x at 16 with their weights in
2 MB pages, and 30 layers of decode attention 0.96x for one sequence (0.99x for 16). In the
engine (`bench.decode_step`'s workload, the weights switched between 2 MB and 4 KB pages
between rounds, three runs) a one-stream decode step took 0.85-0.97x the time, a 16-stream
step 0.97-1.04x (no change beyond the machine's noise).

Linux backs a range with huge pages when asked (`madvise(MADV_HUGEPAGE)`) if
`/sys/kernel/mm/transparent_hugepage/enabled` says `madvise` or `always`; the range must be
asked for before it is first touched, and only whole 2 MB-aligned pages within it are huge.
Elsewhere (THP `never`, other systems) the memory is ordinary and everything works the same.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's value on every architecture


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's `madvise`, where there is one to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = function
    return advise


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a 2 MB boundary and is asked to be
    huge pages. It is a view into a buffer up to 2 MB larger; the pages before its start are
    never touched, so they cost address space, not memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:  # not one whole huge page: an ordinary tensor
        return torch.empty(shape, dtype=dtype)
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None:
        # The whole huge pages inside the tensor; a failure (an old kernel, THP compiled out)
        # leaves ordinary pages.
        madvise(buffer.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return buffer[start : start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`empty`, zeroed."""
    return empty(shape, dtype).zero_()
