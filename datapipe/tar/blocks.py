"""Byte sources for tar parsing: large sequential block reads, or a memory map of a local file.

``reader_for`` picks one; both offer ``peek`` / ``read`` / ``skip`` / ``advance`` and track ``offset``.
"""
from __future__ import annotations

import io
import lzma
import mmap
import os
import zlib

MAX_READ = 32 << 20  # largest single read request: a bogus huge size must not allocate its size up front
# what a damaged compressed stream raises (gzip: BadGzipFile, an OSError; EOFError when cut; bz2: OSError)
_STREAM_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)


class TarFormatError(Exception):
    """A tar header or member that cannot be parsed. ``offset`` is the byte offset of the problem.

    ``intact``: the header itself is sound (its name can be trusted); only its member is refused.
    """

    intact = False

    def __init__(self, message: str, offset: int, key: str | None = None, name: str | None = None):
        super().__init__(message)
        self.offset = offset
        self.key = key
        self.name = name  # the member name the damaged header seems to hold, when it is legible


class TarTruncated(TarFormatError):
    """The shard ends before its end-of-archive blocks: nothing after ``offset`` can be read.

    ``complete`` is True when it ends inside the end-of-archive blocks (every member before is whole).
    """

    complete = False


class BlockReader:
    """Sequential reads from a file object in large blocks, with cheap skips (seek when possible)."""

    def __init__(self, f, *, block_size: int = 4 << 20, seekable: bool | None = None):
        self.f = f
        self.block_size = block_size
        self.buf = b""
        self.pos = 0
        self.offset = 0  # stream offset of buf[pos]
        if seekable is None:
            try:
                seekable = bool(f.seekable())
            except (AttributeError, OSError, ValueError):
                seekable = False
        self.seekable = seekable
        self.size = _file_size(f) if seekable else None  # total bytes, when known (members must fit in it)

    def _fill(self, n: int) -> bool:
        """Make at least ``n`` bytes available at ``pos``; False at end of stream."""
        have = len(self.buf) - self.pos
        if have >= n:
            return True
        parts = [self.buf[self.pos:]] if have else []
        want = max(n - have, self.block_size)
        while have < n:
            chunk = self._read_raw(want)
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
            want = max(n - have, 0) or self.block_size
        self.buf = b"".join(parts) if len(parts) != 1 else parts[0]
        self.pos = 0
        return have >= n

    def _read_raw(self, n: int) -> bytes:
        """``f.read(n)``; a damaged stream (bad gzip CRC, a cut compressed stream) is ``TarTruncated``."""
        try:
            return self.f.read(n)
        except _STREAM_ERRORS as e:
            raise TarTruncated(f"the stream breaks off after byte {self.offset + len(self.buf) - self.pos} "
                               f"({type(e).__name__}: {e})", self.offset) from e

    def drain(self) -> None:
        """At the end of the archive, read what a stream source has left (a compressed stream checks its
        CRC there); a failure is ``TarTruncated`` with ``complete`` set: every member before it was whole."""
        if self.seekable:
            return
        self.buf, self.pos = b"", 0
        try:
            while self._read_raw(self.block_size):
                pass
        except TarTruncated as e:
            e.complete = True
            raise

    def peek(self, n: int) -> bytes | None:
        """The next ``n`` bytes without consuming them, or None near the end."""
        if not self._fill(n):
            return None
        return self.buf[self.pos:self.pos + n]

    def read(self, n: int) -> bytes | None:
        """Exactly ``n`` bytes, or None if the stream ends first (a truncated stream)."""
        have = len(self.buf) - self.pos
        if n - have > self.block_size // 4:
            # a large member: read its remainder straight into the result, skipping the block buffer
            head = self.buf[self.pos:] if have else b""
            rest = _read_exactly(self._read_raw, n - have)
            self.buf, self.pos = b"", 0
            data = head + rest if head else rest
            self.offset += len(data)
            return data if len(data) == n else None
        if not self._fill(n):
            return None
        start = self.pos
        self.pos += n
        self.offset += n
        if start == 0 and n == len(self.buf):
            return self.buf
        return self.buf[start:start + n]

    def advance(self, n: int) -> None:
        self.pos += n
        self.offset += n

    def skip(self, n: int) -> bool:
        """Advance ``n`` bytes without returning them; False if the stream ends first."""
        have = len(self.buf) - self.pos
        if n <= have:
            self.pos += n
            self.offset += n
            return True
        rest = n - have
        self.buf, self.pos = b"", 0
        self.offset += have
        if self.seekable:
            target = self.f.tell() + rest
            size = _file_size(self.f)
            if size is not None and target > size:
                self.offset += max(size - self.f.tell(), 0)
                self.f.seek(0, 2)
                return False
            self.f.seek(target)
            self.offset += rest
            return True
        while rest > 0:
            chunk = self._read_raw(min(rest, self.block_size))
            if not chunk:
                return False
            rest -= len(chunk)
            self.offset += len(chunk)
        return True


def _read_exactly(read, n: int) -> bytes:
    """Up to ``n`` bytes (fewer at the end) from ``read``, in requests of at most ``MAX_READ`` bytes each."""
    data = read(min(n, MAX_READ))
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        chunk = read(min(n - got, MAX_READ))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class MmapReader:
    """The reader interface over a local file: headers and values are read with ``pread`` (one copy straight
    from the page cache, no page of the file mapped into this process), skips are free, and zero-copy views
    (``read_view``) and values over ``MAX_READ`` come from a memory map of the file, made the first time one
    is asked for (a shard read by copy is never mapped).

    Headers and small values come from a small window read ahead in one ``pread`` (``WINDOW`` bytes: a
    sample's headers and its small members together, one system call for them instead of one each; it
    doubles up to ``MAX_WINDOW`` while reads walk through whole windows, as shards of tiny samples do). A value
    that does not lie inside the window is read on its own, straight into its ``bytes`` (never copied twice).

    Mapped pages behind the read position are let go every ``RELEASE_BYTES`` (``MADV_DONTNEED``: the kernel's
    page cache keeps them, this process no longer maps them), so a shard read through costs this process's
    memory (its RSS / PSS) no more than a few blocks; a zero-copy view into a released page reads it again
    from the page cache.
    """

    RELEASE_BYTES = 8 << 20
    WINDOW = 2048
    MAX_WINDOW = 256 << 10

    def __init__(self, f):
        self.f = f
        self._fd = f.fileno()
        self.size = os.fstat(self._fd).st_size
        self._mm = None  # the memory map, made by the first zero-copy view or huge value
        self.offset = 0
        self.seekable = True
        self._released = 0  # bytes [0, _released) are no longer mapped in
        self._next_release = self.RELEASE_BYTES
        self._win = b""  # the bytes of the file from offset _win_at to _win_end, read ahead
        self._win_at = self._win_end = 0
        self._win_size = self.WINDOW

    @property
    def mm(self):
        """The file mapped read-only (made on first use; ``b""`` for an empty file)."""
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if self.size else b""
            if self.size:
                self._mm.madvise(mmap.MADV_SEQUENTIAL)
        return self._mm

    def _release(self) -> None:
        """Let go of the whole mapped pages before the read position."""
        self._next_release = self.offset + self.RELEASE_BYTES
        if self._mm is None or not self.size:
            return  # nothing mapped
        end = (self.offset - mmap.PAGESIZE) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > self._released:
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, self._released, end - self._released)
            except (OSError, ValueError):
                pass
            self._released = end

    def _window(self, n: int) -> bool:
        """Read the window from ``offset`` on (at least ``n`` bytes); False where the file ends first."""
        offset = self.offset
        if offset == self._win_end and self._win_end - self._win_at >= self._win_size:
            self._win_size = min(self._win_size * 2, self.MAX_WINDOW)  # walked through a whole window
        want = min(max(n, self._win_size), self.size - offset)
        if want < n:
            return False
        self._win = os.pread(self._fd, want, offset)
        self._win_at, self._win_end = offset, offset + len(self._win)
        return self._win_end - offset >= n  # shorter: the file shrank under us, read as its end

    def peek(self, n: int) -> bytes | None:
        offset = self.offset
        if offset < self._win_at or offset + n > self._win_end:
            if not self._window(n):
                return None
        at = offset - self._win_at
        return self._win[at:at + n]

    def read(self, n: int) -> bytes | None:
        offset = self.offset
        end = offset + n
        if (offset < self._win_at or end > self._win_end) and n <= self.WINDOW and end <= self.size:
            self._window(n)  # a small read (a header, a small value) outside the window: the window moves on
        if self._win_at <= offset and end <= self._win_end:  # inside the window: a small value, copied from it
            at = offset - self._win_at
            data = self._win[at:at + n]
        elif end > self.size:
            self.offset = self.size
            return None
        elif n > MAX_READ:  # one pread may return less than asked past 2 GB: the mapping copies it whole
            data = self.mm[offset:end]
        else:
            if self._win_at <= offset < self._win_end:
                self._win_size = self.WINDOW  # the window ended inside a large value: keep it small
            data = os.pread(self._fd, n, offset) if n else b""
            if len(data) != n:  # the file shrank under us: read as its end
                self.offset = self.size
                return None
        self.offset = end
        if end >= self._next_release:
            self._release()
        return data

    def read_view(self, n: int) -> memoryview | None:
        """Like ``read`` but a zero-copy view into the mapping (it stays mapped while views live)."""
        end = self.offset + n
        if end > self.size:
            self.offset = self.size
            return None
        self._views = True
        view = memoryview(self.mm)[self.offset:end]
        self.offset = end
        if end >= self._next_release:
            self._release()
        return view

    def skip(self, n: int) -> bool:
        self.offset += n
        if self.offset > self.size:
            self.offset = self.size
            return False
        return True

    def advance(self, n: int) -> None:
        self.offset += n

    def close(self) -> None:
        if self._mm is not None and self.size and not getattr(self, "_views", False):
            self._mm.close()  # with views handed out, the mapping closes when the last one goes


def _file_size(f) -> int | None:
    size = getattr(f, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return None


def reader_for(f, *, seekable: bool | None = None):
    """The fastest reader for ``f``: memory-mapped for a plain local file, else block reads."""
    if isinstance(f, io.FileIO):
        return MmapReader(f)
    return BlockReader(f, seekable=seekable)
