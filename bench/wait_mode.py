"""How the CUDA driver makes a host thread wait for the GPU: spin, yield or block (a benchmark knob).

A CUDA context has one scheduling mode for the process's stream and device waits
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``.item()``). The default ("auto") spins
whenever the machine has more cores than the process has contexts: each waiting thread holds a
core at 100%. Event waits (``cudaEventSynchronize``) spin in every mode unless the event was made
with the blocking-sync flag (seen on the H200: ``tests/bench/test_wait_mode.py``).

``bench/ceiling.py`` rows ending ``_block`` / ``_yield`` run in that mode to find out whether
DALI's waiting threads slow the training step (``ceiling_wait_mode.json``: blocking lowered the
loader's share, but slowed the cached-batch step as much, so no absolute gain; README).
``set_wait_mode`` goes through the driver API (``cuCtxSetFlags``, CUDA 12.1 and later), which
neither torch nor DALI exposes.
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


def _name(sched: int) -> str:
    return next((name for name, value in MODES.items() if value == sched), f"unknown({sched})")


def wait_mode(device: torch.device | int | str | None = None) -> str:
    """The scheduling mode of ``device``'s context: ``auto``, ``spin``, ``yield`` or ``blocking``."""
    return _name(_flags(_current_context(device)) & _SCHED_MASK)


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
    return _name(old & _SCHED_MASK)
