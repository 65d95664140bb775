"""Page-lock memory the process already has (``cudaHostRegister``), so the GPU copies from it directly.

Memory registered this way is pinned memory to CUDA and to torch (``Tensor.is_pinned()`` is true,
``Tensor.pin_memory()`` returns the tensor itself, a ``non_blocking`` copy from it is asynchronous):
a buffer that lives long, such as a worker's recycled shared-memory segment
(:mod:`loaders.dataloader.shm`), is copied to the device without first being copied into pinned
memory. Its owner must keep it mapped while registered, and unregister it only once no copy still
reads it.

A failed CUDA runtime call is remembered by the runtime as the thread's last error, which a later
unrelated kernel launch check of torch's would raise. So registration is tried only where that error
can be cleared: with the CUDA runtime library torch loaded found (Linux, ``/proc/self/maps``).
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

__all__ = ["available", "register", "unregister"]

log = logging.getLogger(__name__)
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


@functools.lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same library, its state shared
            lib.cudaGetLastError.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def available() -> bool:
    """Whether memory can be registered here: a CUDA device and its runtime library found."""
    return torch.cuda.is_available() and _runtime() is not None


def register(ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``ptr`` for CUDA; False (the error cleared, logged once) if refused."""
    if not available():
        return False
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if err != 0:
        _runtime().cudaGetLastError()  # not left for a later launch check to find
        _warn_once(f"cudaHostRegister failed (CUDA error {err}): batches copied through pinned memory")
        return False
    return True


def unregister(ptr: int) -> None:
    """Undo :func:`register` of ``ptr`` (every copy from it must have finished)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        _runtime().cudaGetLastError()
        _warn_once(f"cudaHostUnregister failed (CUDA error {err})")


@functools.lru_cache(maxsize=8)
def _warn_once(message: str) -> None:
    log.warning("datapipe.device.host_register: %s", message)
