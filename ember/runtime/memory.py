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

Note: pooled large buffers
    Huge pages cut the faults but not the kernel's zeroing of every fresh page: a 64 MiB
    output still costs a few ms before the kernel writes a byte, so a memory-bound chain ran
    at 0.55-0.8x of a plain copy_ into an existing tensor. eager's and inductor's outputs pay
    the same (torch's CPU allocator returns large blocks to the OS). ember keeps the storages of
    its large CPU buffers in a process-wide pool instead, and hands one out again once nothing
    but the pool holds it: its storage's use count (a C++ reference count that every tensor
    and view on the storage holds, autograd's saved tensors included) is back to one. A
    buffer a user still holds, or any view of it, is never reused. The pool holds at most
    `config.buffer_pool_mb` (lent and free together; over that, buffers are fresh as before),
    drops free storages of other sizes to make room, and `release_pooled_buffers()` empties it.
    A reused buffer holds old values where a fresh one holds zeros; `empty` promises neither,
    and every kernel writes all of its output. Graphs run on several threads at once: the pool
    hands out a tensor made on the storage under its lock, so the use count that marks a storage
    taken rises in the same step as the check that found it free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from ember.metrics import metrics

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


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _tensor_on(storage: torch.UntypedStorage, size, stride, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, 0, size, stride)


class BufferPool:
    """Large CPU storages the wrapper lends out again once free (Note: pooled large buffers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # graphs may run on several threads at once
        self._storages: OrderedDict[int, list[torch.UntypedStorage]] = OrderedDict()  # by size, oldest first
        self.held_bytes = 0

    def take(self, nbytes: int, limit_bytes: int, huge_pages: bool, size, stride, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `size` and `stride` on a storage of `nbytes` nothing else holds: a free pooled
        one, else a fresh one (pooled when it fits under `limit_bytes`). The tensor is made under the
        lock: its storage's use count rises before another thread can see it free (two threads
        checking the count, then taking, would both take one storage)."""
        with self._lock:
            for storage in self._storages.get(nbytes, ()):
                if _use_count(storage) == 1:
                    metrics.add(pooled_buffers_reused=1)
                    return _tensor_on(storage, size, stride, dtype)
            fresh = torch.UntypedStorage(nbytes)
            if huge_pages:
                advise_huge_pages(torch.empty(0, dtype=torch.uint8).set_(fresh))
            if self._make_room(nbytes, limit_bytes):
                self._storages.setdefault(nbytes, []).append(fresh)
                self._storages.move_to_end(nbytes)
                self.held_bytes += nbytes
            return _tensor_on(fresh, size, stride, dtype)

    def _make_room(self, nbytes: int, limit_bytes: int) -> bool:
        """Drop free storages, least recently grown sizes first, until `nbytes` more fit."""
        if nbytes > limit_bytes:
            return False
        for size in list(self._storages):
            if self.held_bytes + nbytes <= limit_bytes:
                break
            kept = [s for s in self._storages[size] if _use_count(s) > 1]
            self.held_bytes -= size * (len(self._storages[size]) - len(kept))
            if kept:
                self._storages[size] = kept
            else:
                del self._storages[size]
        return self.held_bytes + nbytes <= limit_bytes

    def release(self) -> None:
        """Forget every storage (lent ones live on with their tensors and are freed with them)."""
        with self._lock:
            self._storages.clear()
            self.held_bytes = 0


POOL = BufferPool()


def release_pooled_buffers() -> None:
    """Give the memory of free pooled buffers back (Note: pooled large buffers)."""
    POOL.release()


def empty_large(size, stride, dtype: torch.dtype, nbytes: int, huge_pages: bool, pool_bytes: int) -> torch.Tensor:
    """`torch.empty_strided` on the CPU for a large buffer of `nbytes` (its storage, known when the
    wrapper is generated): a free pooled storage when one fits (Note: pooled large buffers), else a
    fresh one, advised huge when `huge_pages`."""
    if pool_bytes <= 0 or nbytes == 0:
        return empty_huge(size, stride, dtype) if huge_pages else torch.empty_strided(size, stride, dtype=dtype)
    return POOL.take(nbytes, pool_bytes, huge_pages, size, stride, dtype)
