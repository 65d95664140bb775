"""The page cache of local shard files: how much of a file it holds (``mincore``) and dropping it
(``posix_fadvise(POSIX_FADV_DONTNEED)``, then verified), so ``datapipe bench storage`` can read cold."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = None


def _c():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def resident_fraction(path: str) -> float | None:
    """Share of ``path``'s pages in the page cache (0..1; ``mincore``), or None where that cannot be asked."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        lib = _c()
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    try:
        addr = lib.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)


def drop_page_cache(paths: list[str]) -> dict:
    """fsync + ``POSIX_FADV_DONTNEED`` each file, then verify: ``{"dropped", "resident_after", "reason"}``."""
    if not hasattr(os, "posix_fadvise"):
        return {"dropped": False, "resident_after": None, "reason": "posix_fadvise is not available here"}
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    os.fsync(fd)  # dirty pages are not dropped
                except OSError:
                    pass
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as e:
            return {"dropped": False, "resident_after": None, "reason": f"posix_fadvise refused: {e}"}
    fractions = [resident_fraction(p) for p in paths]
    if any(f is None for f in fractions):
        return {"dropped": True, "resident_after": None, "reason": "fadvise accepted; mincore unavailable to verify"}
    sizes = [os.path.getsize(p) for p in paths]
    resident = sum(f * s for f, s in zip(fractions, sizes)) / (sum(sizes) or 1)
    ok = resident < 0.05
    return {"dropped": ok, "resident_after": round(resident, 4),
            "reason": "posix_fadvise(DONTNEED), verified with mincore" if ok else
            f"{resident:.0%} of the bytes stayed cached after fadvise (tmpfs, or a filesystem that ignores it)"}
