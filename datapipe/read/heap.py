"""Keep freed sample memory in the process, so that the next samples' ``bytes`` reuse pages instead of faulting.

A reader hands out every sample as new ``bytes``. With glibc's defaults a batch of them freed at the top of the
heap is given back to the kernel (the trim threshold, 128 KB, rising to at most 64 MB) and values over the mmap
threshold get pages of their own; either way the next batch's memory is fresh pages, each one a page fault that
the kernel zeroes before the read copies over it. At ~100 KB a sample that costs more than the copy itself
(docs/performance.md, "One process, raw bytes"). :func:`keep_freed_memory` raises both thresholds once per
process (``mallopt``): allocations under 32 MB come from the heap, and up to 1 GiB of it freed at the top stays
mapped. The process's resident memory then stays near its peak instead of shrinking between batches.

It runs when a stream starts reading (``StorageOptions(keep_freed_memory=False)`` leaves the allocator alone),
only under glibc, and not where the user set either threshold (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``' ``glibc.malloc`` ones), so their own choice stands.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # freed memory at the top of the heap kept mapped (bytes)
MMAP_THRESHOLD = 32 << 20  # allocations under this come from the heap (glibc's largest on 64-bit)
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_done = False  # set in this process (a forked one inherits it with the setting)


def user_set_thresholds(environ=os.environ) -> bool:
    """Whether the user chose the allocator's thresholds themselves (environment variables or glibc tunables)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return any(environ.get(name) for name in USER_SETTINGS) or any(
        name in tunables for name in ("malloc.trim_threshold", "malloc.mmap_threshold", "malloc.top_pad"))


def keep_freed_memory() -> bool:
    """Raise glibc malloc's trim and mmap thresholds once per process; whether they are raised (see the module)."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or user_set_thresholds():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    _done = True
    return True
