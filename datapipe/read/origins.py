"""Where a DataLoader worker's values came from in their shard files, so its batch can name the file's bytes instead
of carrying a copy of them.

With workers, every raw sample is copied three times: the page cache into the worker's ``bytes`` (its ``pread``),
that ``bytes`` into the worker's shared-memory segment, the segment into the consumer's ``bytes`` in the main
process. On a 16-core host that is memory traffic enough to cap 4 and 8 workers alike (docs/performance.md, #43).
A ``bytes`` never changes, so a value still the very object the reader made is the file's bytes at the offset it
was read from: a worker whose loader asks for it (:func:`enable`) notes each value it reads from a local plain
shard (:func:`note`: the value, its file and offset), and the packing of a batch takes that origin back
(:func:`take`) and sends the span, which the main process reads from the file straight into the consumer's
``bytes`` (``loaders.dataloader.filereads``): two copies, not three. A value the user's code replaced (a new
``bytes``, a decoded array) has no origin and travels as before.

The table holds the values it notes (an ``id`` alone could name a later object at the same address), at most
:data:`BUDGET` bytes of them; past that the oldest are let go (they travel as before). Where values are noted and
none is taken (the user's code turns every value into something else) it switches itself off after
:data:`IDLE_NOTES` notes, so it holds no memory for nothing.
"""
from __future__ import annotations

import os

BUDGET = 64 << 20  # bytes of noted values held at most (a worker's shuffle buffer and batch of ~100 KB samples)
MIN_VALUE = 16 << 10  # smaller values travel in the segment (a span read costs about what their copy does)
IDLE_NOTES = 4096  # noted values in a row none of which was taken: the table switches itself off

_on = False
_table: dict[int, tuple[bytes, tuple, int]] = {}  # id(value) -> (value, its file, offset)
_held = 0
_idle = 0


def enable(on: bool = True) -> None:
    """Note values from now on in this process (a worker whose batches are packed; off: forget every one)."""
    global _on, _idle
    _on, _idle = on, 0
    if not on:
        clear()


def enabled() -> bool:
    return _on


def clear() -> None:
    """Let every noted value go."""
    global _held
    _table.clear()
    _held = 0


def file_of(fd: int) -> tuple | None:
    """The file ``fd`` reads, as :func:`take` names it: ``(path, st_dev, st_ino, st_size, st_mtime_ns)``; None where
    not noting, or where the main process could not open it by a path (an unlinked file, no ``/proc``)."""
    if not _on:
        return None
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
    except OSError:
        return None
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    return path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def note(value: bytes, file: tuple, offset: int) -> None:
    """``value`` (a ``bytes`` just read whole) is ``file``'s bytes at ``offset`` (``file``: :func:`file_of`'s)."""
    global _held, _idle, _on
    n = len(value)
    if not _on or n < MIN_VALUE:
        return
    _idle += 1
    if _idle > IDLE_NOTES:
        enable(False)
        return
    _table[id(value)] = (value, file, offset)
    _held += n
    while _held > BUDGET:  # the oldest first (a dict keeps its insertion order)
        old = _table.pop(next(iter(_table)))[0]
        _held -= len(old)


def take(value) -> tuple[tuple, int] | None:
    """``(file, offset)`` of ``value`` if it is a value noted and still held (then let go), else None; ``file`` is
    :func:`file_of`'s."""
    global _held, _idle
    entry = _table.pop(id(value), None)
    if entry is None:
        return None
    kept, file, offset = entry
    _held -= len(kept)  # ``kept`` is ``value``: the table holds it, so no other object has its id
    _idle = 0
    return file, offset


def available() -> bool:
    """Whether this platform names a descriptor's file (``/proc/self/fd``, Linux)."""
    return os.path.isdir("/proc/self/fd")
