"""Fast WebDataset tar parsing: large sequential reads, no per-member ``tarfile`` objects.

``iter_samples`` walks the 512-byte tar headers itself (ustar, GNU long names, pax paths and
sizes), groups members into samples with webdataset's key/extension rules, and can start at a
sample ordinal by seeking past the data of the samples before it.
"""
from __future__ import annotations

import io
import mmap
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

BLOCK = 512
MAX_READ = 32 << 20  # largest single read request: a bogus huge size must not allocate its size up front
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
        self.size = _file_size(f) if seekable else None  # total bytes, when known (members must fit in it)

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
            rest = _read_exactly(self.f, n - have)
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
            chunk = self.f.read(min(rest, self.block_size))
            if not chunk:
                return False
            rest -= len(chunk)
            self.offset += len(chunk)
        return True


def _read_exactly(f, n: int) -> bytes:
    """Up to ``n`` bytes (fewer at the end), in requests of at most ``MAX_READ`` bytes each."""
    data = f.read(min(n, MAX_READ))
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        chunk = f.read(min(n - got, MAX_READ))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class MmapReader:
    """The reader interface over a memory-mapped local file: slices copy once, skips are free."""

    def __init__(self, f):
        self.f = f
        size = os.fstat(f.fileno()).st_size
        self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if size:
            self.mm.madvise(mmap.MADV_SEQUENTIAL)
        self.size = size
        self.offset = 0
        self.seekable = True

    def peek(self, n: int) -> bytes | None:
        return self.mm[self.offset:self.offset + n] if self.offset + n <= self.size else None

    def read(self, n: int) -> bytes | None:
        end = self.offset + n
        if end > self.size:
            self.offset = self.size
            return None
        data = self.mm[self.offset:end]
        self.offset = end
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
        if self.size and not getattr(self, "_views", False):
            self.mm.close()  # with views handed out, the mapping closes when the last one goes


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


def _octal(field: bytes) -> int:
    try:  # the common case: octal digits, then NUL / space padding (the header checksum guards the rest)
        value = int(field.rstrip(b"\0 "), 8)
        if value >= 0:
            return value
    except ValueError:
        pass
    if field and field[0] & 0x80:  # GNU base-256
        value = int.from_bytes(field[1:], "big")
        return value
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    value = int(text, 8)
    if value < 0 or not text.isdigit():  # int() also takes signs and underscores
        raise ValueError(f"invalid octal number {text!r}")
    return value


def _bad_number(text: str) -> int:
    raise ValueError(f"invalid number {text[:20]!r}")


def _checksum_ok(header: bytes) -> bool:
    """The tar header checksum (byte sum with the checksum field as spaces), via C-speed adler32.

    adler32's low half is ``1 + byte sum`` modulo 65521; the byte sum of a header is below
    2 x 65521, so comparing modulo 65521 is exact but for one impossible-in-practice alias.
    """
    try:
        stored = _octal(header[148:156])
    except ValueError:
        return False
    byte_sum = ((zlib.adler32(header) & 0xFFFF) - 1) % 65521
    unsigned = (byte_sum - sum(header[148:156]) + 256) % 65521
    return stored % 65521 == unsigned


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
    """``key=value`` records of a pax header; ValueError if they are malformed."""
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        field = data[pos:space]
        if not field.isdigit():
            raise ValueError(f"bad pax record length {field[:20]!r}")
        length = int(field)
        if length <= 0:
            break
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


_REGULAR = (b"0", b"\0", b"7")


def next_member(reader, *, resync: bool = False, on_error: Callable[[TarFormatError], None] | None = None
                ) -> tuple[str, int, int] | None:
    """Parse headers up to the next regular file; returns ``(name, size, header_offset)`` or None at the end.

    The reader is left at the member's data; the caller must consume ``padded(size)`` bytes.
    Extension headers (GNU long names, pax ``path`` / ``size``) are applied; other entry types
    are skipped. A bad header (checksum, size field, pax records, a size past the end of a file
    of known size) raises ``TarFormatError`` unless ``resync`` is set, in which case ``on_error``
    is told and the reader scans forward for the next valid header.
    """
    long_name = None
    pax = None
    limit = getattr(reader, "size", None)
    while True:
        header_offset = reader.offset
        header = reader.read(BLOCK)
        if header is None:
            raise truncated(reader, header_offset)
        if header == _ZERO_BLOCK:
            _check_end(reader)
            return None  # end of archive
        err = None
        if not _checksum_ok(header):
            err = TarFormatError("bad tar header checksum", header_offset, name=_legible_name(header))
        else:
            try:
                size = _octal(header[124:136])
                typeflag = header[156:157]
                if typeflag in _REGULAR:
                    if pax is not None:
                        name = pax.get("path") or long_name or _name(header)
                        if "size" in pax:
                            size = int(pax["size"]) if pax["size"].isdigit() else _bad_number(pax["size"])
                    else:
                        name = long_name or _name(header)
                    if limit is not None and header_offset + BLOCK + size > limit:
                        err = TarFormatError(f"tar member of {size} bytes runs past the end of the file "
                                             f"({limit} bytes)", header_offset, name=name)
                    else:
                        return name, size, header_offset
                elif typeflag in (b"L", b"x", b"K", b"g"):
                    if size > 1 << 24:
                        raise ValueError(f"tar extension header of {size} bytes is too large")
                    data = reader.read(padded(size))
                    if data is None:
                        raise TarFormatError("tar stream ends inside an extension header", header_offset)
                    if typeflag == b"L":
                        long_name = bytes(data[:size]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    elif typeflag == b"x":
                        pax = _pax_records(bytes(data[:size]))
                    continue
                else:
                    long_name = pax = None
                    if not reader.skip(padded(size)):
                        raise TarFormatError("tar stream ends inside a non-file entry", header_offset)
                    continue
            except ValueError as e:
                err = TarFormatError(f"bad tar header: {e}", header_offset, name=_legible_name(header))
        if not resync:
            raise err
        on_error(err)
        long_name = pax = None
        if not _resync(reader):
            return None


class TarTruncated(TarFormatError):
    """The shard ends before its end-of-archive blocks: nothing after ``offset`` can be read.

    ``complete`` is True when it ends inside the end-of-archive blocks (every member before is whole).
    """

    complete = False


_LFS_POINTER = b"version https://git-lfs"


def truncated(reader, offset: int) -> TarTruncated:
    """The error for a stream that ends at or after ``offset`` inside a header (or before any header)."""
    left = _bytes_left(reader, offset)
    if offset == 0 and left == 0:
        return TarTruncated("not a tar file: the file is empty", 0)
    if offset == 0:
        head = bytes(reader.mm[:len(_LFS_POINTER)]) if isinstance(reader, MmapReader) else bytes(reader.buf[:64])
        if head.startswith(_LFS_POINTER):
            return TarTruncated(f"not a tar file: a Git LFS pointer of {left} bytes (run `git lfs pull` "
                                "to fetch the real shard)", 0)
        return TarTruncated(f"not a tar file: {left} bytes, shorter than one tar header", 0)
    if left:
        return TarTruncated(f"shard ends at byte {offset + left} inside a tar header (truncated)", offset)
    return TarTruncated(f"shard ends at byte {offset} without the end-of-archive blocks (truncated)", offset)


def _bytes_left(reader, offset: int) -> int:
    """Bytes that were there after ``offset`` when a read of a whole block there failed."""
    if isinstance(reader, MmapReader):
        return max(0, reader.size - offset)
    return max(0, len(reader.buf) - reader.pos)


def _check_end(reader) -> None:
    """After the first end-of-archive block: the second must follow, else the shard was cut there."""
    offset = reader.offset
    if reader.read(BLOCK) is None:
        err = TarTruncated(f"shard ends at byte {offset + _bytes_left(reader, offset)} inside the "
                           "end-of-archive blocks (truncated)", offset)
        err.complete = True
        raise err


def padded(size: int) -> int:
    return (size + BLOCK - 1) & ~(BLOCK - 1)


def _resync(reader) -> bool:
    """Scan forward block by block for a header with a valid checksum; leave the reader before it."""
    while True:
        block = reader.peek(BLOCK)
        if block is None:
            return False
        if block != _ZERO_BLOCK and _checksum_ok(block):
            return True
        reader.advance(BLOCK)


@dataclass(slots=True)
class SampleEvent:
    """One sample position of a shard: the sample, or None where it was damaged (``error`` says why).

    ``ordinal`` is None for damage that cannot be tied to a sample position (the reader lost
    track of where it was); the caller reconciles such losses against the expected count.
    """

    ordinal: int | None
    key: str | None
    sample: dict | None
    error: Exception | None = None


def _skip_member(reader, name: str, size: int, header_offset: int, key: str | None = None) -> None:
    """Skip a member's data and padding; ``TarTruncated`` if the stream ends first."""
    if not reader.skip(padded(size)):
        raise TarTruncated(f"tar stream ends inside member {name!r} ({size} bytes expected)", header_offset, key)


def _damage_owner(err: TarFormatError, next_name: str | None, key_now: str | None,
                  multi: bool | None) -> tuple[str | None, bool]:
    """Which sample a damaged header hit: ``(its key, or None when that cannot be told; whether the
    sample in progress is whole)``. ``next_name`` is the member after the damage, ``key_now`` the
    sample in progress, ``multi`` whether samples here have several members (None: not known yet)."""
    extension_header = err.name is not None and ("@PaxHeader" in err.name or err.name == "././@LongLink")
    guess = split_key(err.name)[0] if err.name and not extension_header else None
    next_match = _KEY_EXT.match(next_name) if next_name is not None else None
    next_key = next_match.group(1) if next_match is not None else None
    if extension_header:
        if key_now is not None and next_key == key_now:
            return key_now, False  # it belonged to the next member of the sample in progress
        return None, True  # it belonged to the next sample's first member
    if guess is not None and guess != key_now and next_key is not None and guess != next_key and multi is not False:
        # a legible name that matches neither neighbour, in a shard of multi-member samples:
        # the name itself is what got damaged
        return None, False
    return guess, False


class _Grouping:
    """Where ``iter_samples`` stands in a shard: the sample being assembled, and what damage left behind."""

    __slots__ = ("url", "start", "stop", "ordinal", "key", "current", "damaged_key", "damage_next", "members",
                 "multi")

    def __init__(self, url: str, start: int, stop: int | None):
        self.url, self.start, self.stop = url, start, stop
        self.ordinal = -1         # ordinal of the sample being assembled
        self.key = None           # its key (None after damage)
        self.current = None       # its dict, or None when it lies before ``start`` or was damaged
        self.damaged_key = None   # a damaged sample's key: its further members are skipped
        self.damage_next = False  # damage without a legible name: the next sample may have lost members too
        self.members = 0          # members of the sample being assembled, plus the one being looked at
        self.multi = None         # whether samples of this shard have several members (None: not known yet)

    def in_range(self, i: int) -> bool:
        return i >= self.start and (self.stop is None or i < self.stop)

    def whole(self) -> SampleEvent:
        """The event of the sample being assembled, once it is known to be complete."""
        return SampleEvent(self.ordinal, self.key, self.current)

    def drop(self, damaged_key: str | None = None) -> None:
        """Give up the sample being assembled; members of ``damaged_key`` that follow are skipped."""
        self.current, self.key, self.damaged_key = None, None, damaged_key

    def damage(self, err: TarFormatError, next_name: str | None) -> list[SampleEvent]:
        """Events for a damaged header that the reader resynchronised past (``next_name``: the member after it)."""
        events = []
        guess, whole = _damage_owner(err, next_name, self.key, self.multi)
        if whole and self.current is not None:
            # a damaged pax / long-name header belongs to the next member: the current sample is whole
            events.append(self.whole())
            self.current, self.key = None, None
        if guess is not None and guess != self.key:
            # the damaged header starts a new sample: the one in progress is complete
            if self.current is not None:
                events.append(self.whole())
            self.ordinal += 1
            self.key = guess
        if self.key is not None:
            if self.in_range(self.ordinal):
                events.append(SampleEvent(self.ordinal, self.key, None, err))
            self.damaged_key = self.key
        else:
            events.append(SampleEvent(None, None, None, err))
        # without a legible name, the sample after the damage may have lost members too
        self.damage_next = guess is None
        self.current, self.key = None, None
        return events

    def count_members(self) -> None:
        """A new key begins: learn from the sample just ended whether samples here have several members."""
        if self.key is not None:
            if self.members > 2:
                self.multi = True
            elif self.multi is None:
                self.multi = False
        self.members = 1

    def begin(self, key: str) -> None:
        """Start the next sample (``key``), after ``count_members``; it is kept only from ordinal ``start`` on."""
        self.ordinal += 1
        self.key = key
        self.damaged_key = None
        self.current = {"__key__": key, "__url__": self.url} if self.ordinal >= self.start else None

    def lost_after_damage(self, key: str, header_offset: int) -> SampleEvent | None:
        """The sample just begun follows illegible damage: count it as damaged (its event, if in range)."""
        self.damage_next = False
        event = None
        if self.in_range(self.ordinal):
            event = SampleEvent(self.ordinal, key, None,
                                TarFormatError("sample follows unreadable tar data", header_offset, key))
        self.drop(damaged_key=key)
        return event


def iter_samples(reader, url: str, *, start: int = 0, stop: int | None = None,
                 resync: bool = False, zero_copy: bool = False) -> Iterator[SampleEvent]:
    """Group tar members into webdataset samples, for sample ordinals ``start <= i < stop``.

    Samples before ``start`` are walked by their headers only (their data is skipped). With
    ``resync`` a damaged region yields an event with ``sample=None`` for the sample it hit and
    parsing goes on at the next valid header; without it, ``TarFormatError`` propagates.
    ``zero_copy`` makes values memoryviews into the mapped file, where the reader allows it.
    """
    g = _Grouping(url, start, stop)
    errors: list[TarFormatError] = []
    read_data = reader.read_view if zero_copy and hasattr(reader, "read_view") else reader.read
    key_ext = _KEY_EXT.match
    while True:
        try:
            m = next_member(reader, resync=resync, on_error=errors.append)
        except TarTruncated as e:
            if e.complete and g.current is not None:  # cut inside the end-of-archive blocks: the last sample is whole
                yield g.whole()
            raise
        if errors:  # the reader resynchronised past damage: settle which sample it hit
            yield from g.damage(errors[-1], m[0] if m is not None else None)
            errors.clear()
        if m is None:
            break
        name, size, header_offset = m
        match = key_ext(name)
        if match is None or (name[:2] == "__" and is_meta(name)):
            _skip_member(reader, name, size, header_offset)
            continue
        key = match.group(1)
        g.members += 1
        if key != g.key:  # the first member of the next sample: the one in progress is complete
            g.count_members()
            if key == g.damaged_key:
                _skip_member(reader, name, size, header_offset, key)
                continue
            if g.current is not None:
                yield SampleEvent(g.ordinal, g.key, g.current)
            g.begin(key)
            if stop is not None and g.ordinal >= stop:
                return
            if g.damage_next:
                event = g.lost_after_damage(key, header_offset)
                if event is not None:
                    yield event
                _skip_member(reader, name, size, header_offset, key)
                continue
        current = g.current
        if current is None:
            _skip_member(reader, name, size, header_offset, key)
            continue
        ext = match.group(2).lower()
        data = read_data(size)
        if data is None:
            raise TarTruncated(f"tar stream ends inside member {name!r} ({size} bytes expected)", header_offset, key)
        pad = padded(size) - size
        if pad and not reader.skip(pad):
            raise TarTruncated(f"tar stream ends inside the padding of member {name!r}", header_offset, key)
        if ext in current:
            yield SampleEvent(g.ordinal, key, None,
                              TarFormatError(f"duplicate file name {name!r} in sample", header_offset, key))
            g.drop(damaged_key=key)
            continue
        current[ext] = data
    if g.current is not None:
        yield g.whole()


def count_samples(reader) -> int:
    """The number of samples in a shard, walking headers only (no data is read); damage raises."""
    n, err = count_until_damage(reader)
    if err is not None:
        raise err
    return n


def count_until_damage(reader) -> tuple[int, TarFormatError | None]:
    """``(complete samples before the first damage, the damage or None)``, walking headers only.

    A sample counts as complete once the header of the next sample (or the end-of-archive block)
    has been read whole: the same rule by which ``iter_samples`` hands a sample out.
    """
    n, last = 0, None
    try:
        while True:
            m = next_member(reader)
            if m is None:
                return n, None
            name, size, header_offset = m
            key = None if is_meta(name) else split_key(name)[0]
            if key is not None and key != last:
                n += 1
                last = key
            _skip_member(reader, name, size, header_offset, key)
    except TarFormatError as e:
        if getattr(e, "complete", False):
            return n, e
        guess = split_key(e.name)[0] if e.name and "@" not in e.name else None
        if guess is not None and guess != last:  # a legible header of the next sample: the one before is whole
            return n, e
        return max(n - 1, 0), e
