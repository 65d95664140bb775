"""Uninitialised ``bytes``, for code that fills them outside the interpreter lock (CPython).

``new_bytes(None, n)`` makes a ``bytes`` of ``n`` bytes not written yet (``PyBytes_FromStringAndSize(NULL, n)``,
as C code makes them); ``data_address(b)`` is where its data starts, for ``preadv`` or ``memmove`` to fill it
before anyone reads or hashes it (a ``bytes`` caches its hash). Used by the read-ahead
(:mod:`datapipe.read.spans`) and by the DataLoader's copy-out (``loaders.dataloader.copyout``).
"""
from __future__ import annotations

import ctypes

new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
new_bytes.restype, new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_as_string = ctypes.pythonapi.PyBytes_AsString
_as_string.restype, _as_string.argtypes = ctypes.c_void_p, (ctypes.py_object,)
_PROBE = b"datapipe"
DATA_OFFSET = _as_string(_PROBE) - id(_PROBE)  # where a bytes object's data starts, from the object's address


def data_address(value: bytes) -> int:
    """The address of ``value``'s data (what ``PyBytes_AsString`` gives, without a foreign call)."""
    return id(value) + DATA_OFFSET
