"""Fast WebDataset tar parsing: large sequential reads, no per-member ``tarfile`` objects.

``iter_samples`` walks the 512-byte tar headers itself (ustar, GNU long names, pax paths and
sizes), groups members into samples with webdataset's key/extension rules, and can start at a
sample ordinal by seeking past the data of the samples before it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")


class TarFormatError(Exception):
    """A tar header or member that cannot be parsed. ``offset`` is the byte offset of the problem."""

    def __init__(self, message: str, offset: int, key: str | None = None, name: str | None = None):
        super().__init__(message)
        self.offset = offset
        self.key = key
        self.name = name  # the member name the damaged header seems to hold, when it is legible


def split_key(name: str) -> tuple[str | None, str | None]:
    """webdataset's rule: the key is everything up to the first dot of the last path component."""
    m = _KEY_EXT.match(name)
    if not m:
        return None, None
    return m.group(1), m.group(2).lower()


def is_meta(name: str) -> bool:
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(_SKIP_META.match(name))


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

    def _fill(self, n: int) -> bool:
        """Make at least ``n`` bytes available at ``pos``; False at end of stream."""
        have = len(self.buf) - self.pos
        if have >= n:
            return True
        parts = [self.buf[self.pos:]] if have else []
        want = max(n - have, self.block_size)
        while have < n:
            chunk = self.f.read(want)
            if not chunk:
                break
            parts.append(chunk)
            have += len(chunk)
            want = max(n - have, 0) or self.block_size
        self.buf = b"".join(parts) if len(parts) != 1 else parts[0]
        self.pos = 0
        return have >= n

    def read(self, n: int) -> bytes | None:
        """Exactly ``n`` bytes, or None if the stream ends first (a truncated stream)."""
        if not self._fill(n):
            return None
        start = self.pos
        self.pos += n
        self.offset += n
        if start == 0 and n == len(self.buf):
            return self.buf
        return self.buf[start:start + n]

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
            chunk = self.f.read(min(rest, self.block_size))
            if not chunk:
                return False
            rest -= len(chunk)
            self.offset += len(chunk)
        return True


def _file_size(f) -> int | None:
    size = getattr(f, "size", None)
    if isinstance(size, int):
        return size
    try:
        import os

        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return None


def _octal(field: bytes) -> int:
    if field and field[0] & 0x80:  # GNU base-256
        value = int.from_bytes(field[1:], "big")
        return value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(header: bytes) -> bool:
    try:
        stored = _octal(header[148:156])
    except ValueError:
        return False
    unsigned = sum(header) - sum(header[148:156]) + 256
    return stored == unsigned


def _name(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _legible_name(header: bytes) -> str | None:
    """The name field of a damaged header, if it still looks like a sample member's name."""
    raw = header[0:100].split(b"\0", 1)[0]
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not name or not name.isprintable():
        return None
    return name


def _pax_records(data: bytes) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        if length <= 0:
            break
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


@dataclass
class Member:
    """A regular file in a tar: its name, data offset and size."""

    name: str
    offset: int
    size: int


def iter_members(reader: BlockReader, *, want: Callable[[str], bool] = lambda name: True,
                 resync: bool = False, on_error: Callable[[TarFormatError], None] | None = None
                 ) -> Iterator[tuple[Member, bytes | None]]:
    """Yield ``(member, data)`` for regular files; ``data`` is None where ``want(name)`` is False.

    A bad header raises ``TarFormatError`` unless ``resync`` is set, in which case ``on_error``
    is told and the reader scans forward for the next valid header.
    """
    long_name = None
    pax: dict[str, str] = {}
    while True:
        header_offset = reader.offset
        header = reader.read(BLOCK)
        if header is None:
            return  # end of stream without end-of-archive blocks: tolerated, like tarfile
        if header == _ZERO_BLOCK:
            return
        if not _checksum_ok(header):
            err = TarFormatError("bad tar header checksum", header_offset, name=_legible_name(header))
            if not resync:
                raise err
            on_error(err)
            long_name, pax = None, {}
            if not _resync(reader):
                return
            continue
        try:
            size = _octal(header[124:136])
        except ValueError as e:
            raise TarFormatError(f"bad size field in tar header: {e}", header_offset) from e
        typeflag = header[156:157]
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if typeflag in (b"L", b"x", b"K", b"g"):
            if size > 1 << 24:
                raise TarFormatError(f"tar extension header of {size} bytes is too large", header_offset)
            data = reader.read(padded)
            if data is None:
                raise TarFormatError("tar stream ends inside an extension header", header_offset)
            if typeflag == b"L":
                long_name = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif typeflag == b"x":
                pax = _pax_records(data[:size])
            continue
        name = pax.get("path") or long_name or _name(header)
        if "size" in pax:
            size = int(pax["size"])
            padded = (size + BLOCK - 1) // BLOCK * BLOCK
        long_name, pax = None, {}
        member = Member(name, reader.offset, size)
        if typeflag not in (b"0", b"\0", b"7") or not want(name):
            if not reader.skip(padded):
                raise TarFormatError(f"tar stream ends inside member {name!r}", header_offset)
            if typeflag in (b"0", b"\0", b"7"):
                yield member, None
            continue
        data = reader.read(size)
        if data is None:
            raise TarFormatError(f"tar stream ends inside member {name!r} ({size} bytes expected)", header_offset)
        if padded != size and not reader.skip(padded - size):
            raise TarFormatError(f"tar stream ends inside the padding of member {name!r}", header_offset)
        yield member, data


def _resync(reader: BlockReader) -> bool:
    """Scan forward block by block for a header with a valid checksum; leave the reader before it."""
    while True:
        if not reader._fill(BLOCK):
            return False
        block = reader.buf[reader.pos:reader.pos + BLOCK]
        if block != _ZERO_BLOCK and _checksum_ok(block):
            return True
        reader.pos += BLOCK
        reader.offset += BLOCK


@dataclass
class SampleEvent:
    """One sample position of a shard: the sample, or None where it was damaged (``error`` says why).

    ``ordinal`` is None for damage that cannot be tied to a sample position (the reader lost
    track of where it was); the caller reconciles such losses against the expected count.
    """

    ordinal: int | None
    key: str | None
    sample: dict | None
    error: Exception | None = None


def iter_samples(reader: BlockReader, url: str, *, start: int = 0, stop: int | None = None,
                 resync: bool = False) -> Iterator[SampleEvent]:
    """Group tar members into webdataset samples, for sample ordinals ``start <= i < stop``.

    Samples before ``start`` are walked by their headers only (their data is skipped). With
    ``resync`` a damaged region yields an event with ``sample=None`` for the sample it hit and
    parsing goes on at the next valid header; without it, ``TarFormatError`` propagates.
    """
    state = {"ordinal": -1, "key": None}
    errors: list[TarFormatError] = []
    current: dict | None = None
    damaged_key = None

    def want(name: str) -> bool:
        key, _ = split_key(name)
        if key is None or is_meta(name):
            return False
        return state["ordinal"] + (key != state["key"]) >= start

    def in_range(i: int) -> bool:
        return i >= start and (stop is None or i < stop)

    damage_next = False
    for member, data in iter_members(reader, want=want, resync=resync, on_error=errors.append):
        if errors:
            err = errors[-1]
            errors.clear()
            extension_header = err.name is not None and "@PaxHeader" in err.name or err.name == "././@LongLink"
            guess = split_key(err.name)[0] if err.name and not extension_header else None
            if extension_header and current is not None:
                # a damaged pax / long-name header belongs to the next member: the current sample is whole
                yield SampleEvent(state["ordinal"], state["key"], current)
                current, state["key"] = None, None
            if guess is not None and guess != state["key"]:
                # the damaged header starts a new sample: the one in progress is complete
                if current is not None:
                    yield SampleEvent(state["ordinal"], state["key"], current)
                state["ordinal"] += 1
                state["key"] = guess
                current = {} if state["ordinal"] >= start else None
            if state["key"] is not None:
                if in_range(state["ordinal"]):
                    yield SampleEvent(state["ordinal"], state["key"], None, err)
                damaged_key = state["key"]
            else:
                yield SampleEvent(None, None, None, err)
            # without a legible name, the sample after the damage may have lost members too
            damage_next = guess is None
            current, state["key"] = None, None
        name = member.name
        if is_meta(name):
            continue
        key, ext = split_key(name)
        if key is None or key == damaged_key:
            continue
        if key != state["key"]:
            if current is not None:
                yield SampleEvent(state["ordinal"], state["key"], current)
            state["ordinal"] += 1
            state["key"] = key
            damaged_key = None
            if stop is not None and state["ordinal"] >= stop:
                return
            current = {"__key__": key, "__url__": url} if state["ordinal"] >= start else None
            if damage_next:
                damage_next = False
                if in_range(state["ordinal"]):
                    yield SampleEvent(state["ordinal"], key, None,
                                      TarFormatError("sample follows unreadable tar data", member.offset, key))
                current, damaged_key = None, key
                continue
        if current is not None:
            if ext in current:
                err = TarFormatError(f"duplicate file name {name!r} in sample", member.offset, key)
                yield SampleEvent(state["ordinal"], key, None, err)
                current, damaged_key, state["key"] = None, key, None
                continue
            current[ext] = data
    if errors:
        if state["key"] is not None and in_range(state["ordinal"]):
            yield SampleEvent(state["ordinal"], state["key"], None, errors[-1])
        else:
            yield SampleEvent(None, None, None, errors[-1])
    elif current is not None:
        yield SampleEvent(state["ordinal"], state["key"], current)


def count_samples(reader: BlockReader) -> int:
    """The number of samples in a shard, walking headers only (no data is read)."""
    n, last = 0, None
    for member, _ in iter_members(reader, want=lambda name: False):
        if is_meta(member.name):
            continue
        key, _ = split_key(member.name)
        if key is not None and key != last:
            n += 1
            last = key
    return n
