"""`engine.huge_pages`: tensors that start on a 2 MB boundary in a range Linux was asked to
back with huge pages, and ordinary tensors where a huge page would not fit."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine import huge_pages


def vm_flags(address: int) -> list[str] | None:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps), None
    where no mapping does."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_large_tensor_starts_on_a_huge_page_and_holds_what_is_written(
    dtype: torch.dtype,
) -> None:
    shape = (3, 5, (1 << 20) + 7)  # not a whole number of huge pages
    tensor = huge_pages.zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not tensor.any()
    tensor[-1, -1, -1] = 7  # the last element is the tensor's own, not the buffer's slack
    assert tensor.sum().item() == 7


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists(), reason="a kernel without transparent huge pages")
def test_the_range_is_marked_for_huge_pages() -> None:
    # "hg": madvise(MADV_HUGEPAGE) took, whether or not the kernel finds free huge pages now.
    tensor = huge_pages.empty((4 << 20,), torch.uint8)
    assert "hg" in (vm_flags(tensor.data_ptr()) or [])
    ordinary = torch.empty(4 << 20, dtype=torch.uint8)
    assert "hg" not in (vm_flags(ordinary.data_ptr()) or [])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc to look in")
def test_the_memory_is_unmapped_once_the_tensor_is_freed() -> None:
    tensor = huge_pages.zeros((3 << 20,), torch.float32)
    view = tensor[5:]  # a view keeps the mapping too
    address = tensor.data_ptr()
    del tensor
    gc.collect()
    assert vm_flags(address) is not None
    del view
    gc.collect()
    assert vm_flags(address) is None


def test_a_tensor_smaller_than_a_huge_page_is_ordinary() -> None:
    tensor = huge_pages.zeros((1000,), torch.float32)
    assert tensor.shape == (1000,) and not tensor.any()
    assert tensor.untyped_storage().nbytes() == 4000  # no 2 MB of slack for a small one
