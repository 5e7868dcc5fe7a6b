"""Large CPU buffers backed by transparent huge pages.

Note: huge pages for fresh buffers
    torch's CPU allocator gets a large buffer straight from mmap, and frees it back with
    munmap, so every call of a graph faults its large buffers in anew, 4 KiB at a time: a
    kernel fault, zeroing and a page-table entry per page. On the VMs here that costs about
    19 ms per 64 MiB, five times the memory-bound kernel that then writes it (a 16M-element
    chain of adds runs in 3.5 ms). Faulting in 2 MiB pages instead takes a 512th of the
    faults, and the same chain with its output in huge pages runs in about 5 ms.

    Linux backs a mapping with huge pages at fault time only where the process asked for
    them (`madvise(MADV_HUGEPAGE)`) when transparent huge pages are in "madvise" mode, the
    default of most distributions; in "always" mode it already does, in "never" mode it
    will not. So the wrapper allocates each large CPU buffer with `empty_huge`: the tensor
    as torch allocates it, then the advice on the 2 MiB-aligned pages inside it, before
    any kernel touches them. It changes where the bytes live, never their values; eager's
    own allocations are left as they are (`THP_MEM_ALLOC_ENABLE=1` asks torch for the
    same at the process level).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGE_MIN_BYTES = 4 << 20  # smaller buffers may not hold one aligned huge page
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _madvise():
    """libc's madvise when asking for huge pages can change anything, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mode = THP_MODE_FILE.read_text()
    except OSError:
        return None
    if "[madvise]" not in mode:  # "always" backs every mapping already; "never" never does
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def huge_pages_available() -> bool:
    return _madvise() is not None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back the untouched pages of `t`'s storage with huge pages.
    Returns whether the advice was given (it is only advice: a failure changes nothing)."""
    madvise = _madvise()
    storage = t.untyped_storage()
    if madvise is None or t.device.type != "cpu" or storage.nbytes() < HUGE_PAGE_BYTES:
        return False
    begin = storage.data_ptr()
    first = -(-begin // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = (begin + storage.nbytes()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return last > first and madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty_huge(size, stride, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty_strided` on the CPU, its pages advised huge (Note: huge pages for fresh buffers)."""
    t = torch.empty_strided(size, stride, dtype=dtype)
    advise_huge_pages(t)
    return t
