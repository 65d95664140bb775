"""Compressed shards: gzip, bz2 and xz told by their magic bytes (whatever the name, as ``tarfile`` does) and
read through the stdlib decompressors; zstd refused in so many words."""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os

from datapipe.errors import DataError
from datapipe.storage.locations import redact_url

REMOTE_BLOCK = 8 << 20  # remote reads: the request size, and the read-ahead block of compressed shards

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
SNIFF = 4 << 20  # the first read of a stream shard: what the tar reader would ask for first anyway


def compression_of(head: bytes) -> str | None:
    """``"gzip"``, ``"bz2"``, ``"xz"`` or ``"zstd"`` by the magic bytes at the start of a file, else None."""
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def decompress(url: str, raw, *, seekable: bool):
    """``(file, seekable)``: ``raw`` itself for a plain tar, or a stdlib decompressor over it for gzip, bz2
    or xz content, told by its first bytes whatever the name (as ``tarfile`` does). zstd: ``DataError``."""
    if isinstance(raw, io.FileIO):
        head, f = os.pread(raw.fileno(), 8, 0), raw  # a local file: look without moving
    else:
        head = raw.read(SNIFF)
        f = Prefixed(raw, head)
    kind = compression_of(head)
    if kind is None:
        return f, seekable
    if kind == "zstd":
        f.close()
        raise DataError("zstd-compressed shards are not supported: decompress them first (zstd -d), or write "
                        "plain or gzip tars", url=redact_url(url))
    ahead = ReadAhead(f, block=(1 << 20) if isinstance(raw, io.FileIO) else REMOTE_BLOCK)
    opener = {"bz2": bz2.BZ2File, "xz": lzma.LZMAFile}.get(kind)
    stream = gzip.GzipFile(fileobj=ahead, mode="rb") if kind == "gzip" else opener(ahead, mode="rb")
    return Decompressed(stream, ahead), False


class Prefixed:
    """``raw`` after its first bytes (``head``) were read to look at them: they are served again first."""

    def __init__(self, raw, head: bytes):
        self.raw = raw
        self.head = head
        self.pos = 0  # position while inside ``head``; past it, ``raw``'s own

    @property
    def size(self) -> int | None:
        return getattr(self.raw, "size", None)

    @property
    def retried(self) -> int:
        return getattr(self.raw, "retried", 0)

    def read(self, n: int = -1) -> bytes:
        h = len(self.head)
        if self.pos >= h:
            return self.raw.read(n)
        if n is None or n < 0:
            data, self.pos = self.head[self.pos:] + self.raw.read(), h
            return data
        data = self.head[self.pos:self.pos + n]
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return self.raw.seekable()

    def tell(self) -> int:
        return self.pos if self.pos < len(self.head) else self.raw.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 1:
            pos += self.tell()
        elif whence == 2:
            if self.size is None:
                raise OSError("cannot seek from the end of a file of unknown size")
            pos += self.size
        h = len(self.head)
        if pos < h:
            self.pos = pos
            if self.raw.tell() != h:
                self.raw.seek(h)
        else:
            self.pos = h
            self.raw.seek(pos)
        return pos

    def close(self) -> None:
        self.raw.close()


class Decompressed:
    """A decompressing reader (gzip, bz2, xz) over ``source`` (``myfileobj``), closed together with it.

    It reads in pieces, so that a stream that breaks off (cut, bad CRC) still hands out what was
    decompressed before the break; the decompressor's error comes with the next read.
    """

    PIECE = 1 << 18

    def __init__(self, stream, source):
        self.stream = stream
        self.myfileobj = source
        self.pending: BaseException | None = None

    def read(self, n: int = -1) -> bytes:
        if self.pending is not None:
            err, self.pending = self.pending, None
            raise err
        n = (1 << 62) if n is None or n < 0 else n
        parts, got = [], 0
        while got < n:
            try:
                chunk = self.stream.read1(min(n - got, self.PIECE))  # read() would drop a piece on error
            except Exception as e:
                if not parts:
                    raise
                self.pending = e
                break
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.myfileobj.close()


class ReadAhead:
    """Sequential reads served from large blocks of ``raw``: gzip asks for a few KB at a time, which
    would otherwise be one remote request each."""

    def __init__(self, raw, *, block: int):
        self.raw = raw
        self.block = block
        self.buf = b""
        self.pos = 0

    @property
    def retried(self) -> int:
        return getattr(self.raw, "retried", 0)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            rest, self.buf, self.pos = self.buf[self.pos:], b"", 0
            return rest + self.raw.read()
        if self.pos >= len(self.buf):
            if n >= self.block:
                return self.raw.read(n)
            self.buf, self.pos = self.raw.read(self.block), 0
        data = self.buf[self.pos:self.pos + n]
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.raw.close()
