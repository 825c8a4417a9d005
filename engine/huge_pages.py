"""CPU memory backed by 2 MB pages where Linux gives them (transparent huge pages).

Every decode step reads all of the model's weights and its sequences' K/V from memory: about
270 MB of packed bf16 weights and, for 16 streams over 1,544-token contexts, 190 MB of K/V.
In 4 KB pages that is some 115,000 pages a step, far more than the TLB holds, so nearly every
page costs a page walk, and the hardware prefetchers stop at each page's end. In 2 MB pages it
is a few hundred, and projections and decode attention measured faster (figures:
docs/performance.md).

Linux backs a range with huge pages when asked (`madvise(MADV_HUGEPAGE)`) if
`/sys/kernel/mm/transparent_hugepage/enabled` says `madvise` or `always`; the range must be
asked for before it is first touched, and only whole 2 MB-aligned pages within it are huge.
Each tensor here gets a private anonymous mapping of its own (not the allocator's heap, whose
memory may already be touched and outlives the tensor), unmapped when the tensor is freed.
Elsewhere (THP `never`, other systems) the memory is ordinary and everything works the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a 2 MB boundary and is asked to be
    huge pages: a view into a mapping up to 2 MB larger, whose pages before the tensor's start
    are never touched (address space, not memory). Under one huge page: an ordinary tensor."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(
        -1,
        nbytes + HUGE_PAGE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,  # shared memory has its own THP setting
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -buffer.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux's
    if advice is not None:
        # The whole huge pages inside the tensor; a kernel without THP refuses: ordinary pages.
        with contextlib.suppress(OSError):
            mapping.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return buffer[start : start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`empty`, zeroed."""
    return empty(shape, dtype).zero_()


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's `malloc_trim`), once large
    tensors that lived there have been freed: glibc keeps freed heap memory resident, so
    tensors moved into mappings of their own would otherwise still count in the process's
    memory. Nothing elsewhere (no glibc)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
