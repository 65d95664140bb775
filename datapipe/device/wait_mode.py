"""How the CUDA driver makes a host thread wait for the GPU: spin, yield or block.

A CUDA context has one scheduling mode for every wait in the process (``cudaStreamSynchronize``,
``cudaEventSynchronize``, ``.item()``). The default ("auto") spins whenever the machine has more
cores than the process has contexts, so each thread waiting on the GPU holds a core at 100%.
A DALI pipeline keeps a dozen threads that wait on the GPU and on the hardware JPEG decoder every
batch; when they spin together they can outnumber the cores for a moment, and the training
thread that launches the step's kernels is the one the OS scheduler sets aside
(``bench/step_anatomy.py``: launch calls of a few microseconds taking milliseconds).

``set_wait_mode("blocking")`` switches the current device's context to block on an OS primitive
instead (``CU_CTX_SCHED_BLOCKING_SYNC``); it goes through the driver API (``cuCtxSetFlags``,
CUDA 12.1 and later) because neither torch nor DALI exposes it.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["MODES", "set_wait_mode", "wait_mode"]

MODES = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*
_SCHED_MASK = 0x07


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError("the CUDA driver library (libcuda.so.1) is not loadable here") from e
    for name in ("cuCtxGetFlags", "cuCtxSetFlags"):
        if not hasattr(lib, name):
            raise RuntimeError(f"this CUDA driver has no {name} (it needs CUDA 12.1 or later)")
    return lib


def _current_context(device: torch.device | int | str | None) -> ctypes.CDLL:
    """Make ``device``'s context current in this thread (torch creates it) and return the driver."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available: there is no context whose wait mode could be set")
    index = None if device is None else torch.device(device).index  # torch.device(0) is cuda:0
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.set_device(index)
    torch.cuda.synchronize(index)  # the context exists and is current in this thread
    return _driver()


def _flags(lib: ctypes.CDLL) -> int:
    flags = ctypes.c_uint(0)
    rc = lib.cuCtxGetFlags(ctypes.byref(flags))
    if rc != 0:
        raise RuntimeError(f"cuCtxGetFlags failed (CUresult {rc})")
    return flags.value


def wait_mode(device: torch.device | int | str | None = None) -> str:
    """The scheduling mode of ``device``'s context: ``auto``, ``spin``, ``yield`` or ``blocking``."""
    sched = _flags(_current_context(device)) & _SCHED_MASK
    return next((name for name, value in MODES.items() if value == sched), f"unknown({sched})")


def set_wait_mode(mode: str, device: torch.device | int | str | None = None) -> str:
    """Set how every thread of this process waits for ``device`` (one of ``MODES``); returns the
    previous mode, so a caller can put it back."""
    if mode not in MODES:
        raise ValueError(f"wait mode {mode!r}: use one of {', '.join(MODES)}")
    lib = _current_context(device)
    old = _flags(lib)
    rc = lib.cuCtxSetFlags(ctypes.c_uint((old & ~_SCHED_MASK) | MODES[mode]))
    if rc != 0:
        raise RuntimeError(f"cuCtxSetFlags failed (CUresult {rc})")
    sched = old & _SCHED_MASK
    return next((name for name, value in MODES.items() if value == sched), "auto")
