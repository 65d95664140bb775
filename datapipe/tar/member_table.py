"""A shard's member table: where each sample's values lie, written by ``ShardWriter`` as the shard's last member.

Reading a tar means walking its 512-byte headers, a Python step per member. A plain tar written by
``ShardWriter`` ends with one more member, ``.datapipe-members`` (a hidden file's name, with no key before its
dot: webdataset, DALI's reader scanning a tar without an index, DALI's index tool and this package's walk all
skip it, as they skip ``.DS_Store``), whose data lists every sample's key and every value's extension,
offset and size, grouped exactly as the walk groups them (webdataset's key / extension rules). A local read
then takes each value with one ``pread`` at its offset, with no header read or parsed.

The table trusts nothing it cannot check: it must end right before the end-of-archive blocks (a member
appended after it, as ``tar -r`` would, leaves it out), its header must be sound, its bytes must match the
CRC-32 in its footer, and every value must lie inside the members before it. A shard without a sound table
is walked as before.

Layout (little-endian): ``<8sQQQII`` (magic, samples, members, the table header's offset, bytes of the
extension names, bytes of the keys), the extension names and the keys (UTF-8, each ended by NUL), members per
sample (u32), each member's extension number (u16), offset (u64) and size (u64), zero padding, and a 24-byte
footer ``<IIQ8s`` (CRC-32 of what precedes it, 0, the table's length, magic) ending on a 512-byte block.
"""
from __future__ import annotations

import os
import struct
import zlib
from array import array
from typing import Iterator

from datapipe.tar.headers import BLOCK, TarTruncated, _plain_member, is_meta, split_key
from datapipe.tar.read_ahead import ReadAhead

NAME = ".datapipe-members"
_HEAD = struct.Struct("<8sQQQII")
_FOOT = struct.Struct("<IIQ8s")
_MAGIC, _END = b"DPMEMBR1", b"DPMEMEND"
TAIL = 10240 + 2 * BLOCK  # the end-of-archive blocks with tarfile's record padding, plus a block
_MAX_READ = 32 << 20  # one pread may return less than asked past 2 GB; larger values are read in parts


def bytes_for(key: str, exts) -> int:
    """An upper bound on what a sample adds to the table (its key, and each value as if its extension were new)."""
    return len(key.encode("utf-8", "surrogateescape")) + 5 + sum(19 + len(e) for e in exts)


FIXED_BYTES = 2 * BLOCK + _HEAD.size + _FOOT.size  # the table's header block, its head and footer, padding


class TableBuilder:
    """Collects the members a writer writes (name, data offset, size) and groups them as the walk would.

    ``blob(end)`` is the table's data, or None where the walk would see anything but plain samples (a
    duplicate extension, a member without an extension): such a shard is written without a table.
    """

    def __init__(self):
        self.keys: list[str] = []
        self.per_sample = array("I")
        self.ext_ids = array("H")
        self.offsets = array("Q")
        self.sizes = array("Q")
        self._exts: dict[str, int] = {}
        self._seen: set[str] = set()
        self.ok = True

    def add(self, name: str, offset: int, size: int) -> None:
        if not self.ok:
            return
        if is_meta(name):
            return  # skipped by the walk, as by webdataset
        key, ext = split_key(name)
        if key is None:
            self.ok = False  # the walk skips it; keep its rules in one place: no table
            return
        if not self.keys or key != self.keys[-1]:
            self.keys.append(key)
            self.per_sample.append(0)
            self._seen = set()
        if ext in self._seen or len(self._exts) >= 0xFFFF:
            self.ok = False  # a duplicate extension is damage to the walk
            return
        self._seen.add(ext)
        self.per_sample[-1] += 1
        self.ext_ids.append(self._exts.setdefault(ext, len(self._exts)))
        self.offsets.append(offset)
        self.sizes.append(size)

    def blob(self, end: int) -> bytes | None:
        """The table's data for a shard whose members end at byte ``end`` (where the table's header goes)."""
        if not self.ok or not self.keys:
            return None
        exts = "".join(e + "\0" for e in self._exts).encode("utf-8", "surrogateescape")
        keys = "".join(k + "\0" for k in self.keys).encode("utf-8", "surrogateescape")
        body = b"".join((_HEAD.pack(_MAGIC, len(self.keys), len(self.offsets), end, len(exts), len(keys)), exts,
                         keys, self.per_sample.tobytes(), self.ext_ids.tobytes(), self.offsets.tobytes(),
                         self.sizes.tobytes()))
        body += bytes(-(len(body) + _FOOT.size) % BLOCK)
        length = len(body) + _FOOT.size
        return body + _FOOT.pack(zlib.crc32(body), 0, length, _END)


class MemberTable:
    """A shard's samples as the walk would find them: ``keys[i]`` and ``members[i]``, a tuple of
    ``(extension, offset, size)`` per value, in file order; ``end``: where the members end."""

    __slots__ = ("keys", "members", "end")

    def __init__(self, keys: list[str], members: list[tuple], end: int):
        self.keys, self.members, self.end = keys, members, end

    def __len__(self) -> int:
        return len(self.keys)


def load(fd: int, size: int) -> MemberTable | None:
    """The member table of the local shard open as ``fd`` (``size`` bytes), or None where it has no sound one."""
    tail_at = max(0, size - TAIL)
    tail = os.pread(fd, size - tail_at, tail_at)
    end = len(tail.rstrip(b"\0"))
    if end < _FOOT.size or (tail_at + end) % BLOCK or len(tail) - end < 2 * BLOCK or tail[end - 8:end] != _END:
        return None
    crc, _, length, _ = _FOOT.unpack_from(tail, end - _FOOT.size)
    start = tail_at + end - length  # the table's data
    header_at = start - BLOCK
    if length < _HEAD.size + _FOOT.size or length % BLOCK or header_at < 0:
        return None
    raw = os.pread(fd, length + BLOCK, header_at)
    if len(raw) != length + BLOCK or not _sound_header(raw[:BLOCK], length):
        return None
    blob = memoryview(raw)[BLOCK:]
    if zlib.crc32(blob[:length - _FOOT.size]) != crc:
        return None
    return _parse(blob, header_at)


def of_reader(reader) -> MemberTable | None:
    """The member table of the shard a tar reader reads, where it is a local plain file (``MmapReader``) with a
    sound one; else None."""
    from datapipe.tar.blocks import MmapReader

    return load(reader._fd, reader.size) if type(reader) is MmapReader else None


def _sound_header(header: bytes, length: int) -> bool:
    member = _plain_member(header, 0, None)
    return member is not None and member[0] == NAME and member[1] == length


def _parse(blob: memoryview, header_at: int) -> MemberTable | None:
    magic, n, m, end, ext_bytes, key_bytes = _HEAD.unpack_from(blob, 0)
    if magic != _MAGIC or end != header_at:
        return None
    at = _HEAD.size
    exts = bytes(blob[at:at + ext_bytes]).decode("utf-8", "surrogateescape").split("\0")[:-1]
    at += ext_bytes
    keys = bytes(blob[at:at + key_bytes]).decode("utf-8", "surrogateescape").split("\0")[:-1]
    at += key_bytes
    arrays = []
    for code, count in (("I", n), ("H", m), ("Q", m), ("Q", m)):
        a = array(code)
        nbytes = a.itemsize * count
        if at + nbytes > len(blob):
            return None
        a.frombytes(blob[at:at + nbytes])
        arrays.append(a)
        at += nbytes
    per_sample, ext_ids, offsets, sizes = arrays
    if len(keys) != n or sum(per_sample) != m or (m and max(ext_ids) >= len(exts)):
        return None
    names = [exts[i] for i in ext_ids]
    flat = list(zip(names, offsets.tolist(), sizes.tolist()))
    last = 0
    for _, offset, value_size in flat:  # in file order, each inside the members, after a header of its own
        if offset < last + BLOCK or offset + value_size > end:
            return None
        last = offset + value_size
    members, at = [], 0
    for count in per_sample:
        members.append(tuple(flat[at:at + count]))
        at += count
    return MemberTable(keys, members, end)


class Position:
    """Where a table read stands: the ordinal and key of the sample last handed out (as the walk's grouping)."""

    __slots__ = ("ordinal", "key")

    def __init__(self):
        self.ordinal, self.key = -1, None


PASSED: dict = {}  # in place of a sample the caller did not want read (``samples``' ``keep``); never filled


def samples(table: MemberTable, fd: int, url: str, position: Position, *, start: int, stop: int | None,
            read_large=None, keep=None, read=None, threads: int = 0) -> Iterator[dict]:
    """The samples ``start <= i < stop`` of the table's shard as dicts (``__key__``, ``__url__``, one ``bytes``
    per extension), each value one ``pread``; ``position`` follows the ordinal and key. A value the file no
    longer holds whole (it shrank) raises ``TarTruncated``. ``read_large(offset, size)`` reads values over
    32 MB (the reader's memory map); ``read(offset, size)``, if given, reads every value (zero-copy views).
    Where ``keep(i)`` is false, ``PASSED`` comes instead and nothing is read. ``threads`` >= 1: the values are
    read ahead instead, a few MB of samples at a time in that many pool threads
    (:func:`datapipe.read.spans.start_spans`), the next chunk while this one is handed out."""
    keys, members = table.keys, table.members
    stop = len(keys) if stop is None else min(stop, len(keys))
    ahead = ReadAhead(members, fd, stop, keep, threads) if threads and read is None else None
    try:
        yield from _samples(keys, members, fd, url, position, start, stop, read_large, keep, read, ahead)
    finally:
        if ahead is not None:
            ahead.close()


def _samples(keys, members, fd, url, position, start, stop, read_large, keep, read, ahead) -> Iterator[dict]:
    pread = os.pread
    for i in range(start, stop):
        key = keys[i]
        if keep is not None and not keep(i):
            position.ordinal, position.key = i, key
            yield PASSED
            continue
        sample = {"__key__": key, "__url__": url}
        values = ahead.values(i) if ahead is not None else None
        if values is not None:
            for (ext, _, _), data in zip(members[i], values):
                sample[ext] = data
        else:
            for ext, offset, size in members[i]:
                if read is not None:
                    data = read(offset, size)
                else:
                    data = (pread(fd, size, offset) if size <= _MAX_READ or read_large is None
                            else read_large(offset, size))
                if data is None or len(data) != size:
                    raise TarTruncated(f"tar stream ends inside member {key}.{ext} ({size} bytes expected)",
                                       offset, key)
                sample[ext] = data
        position.ordinal, position.key = i, key
        yield sample
