"""Tar headers: ustar, GNU long names and pax paths / sizes, checksums, end-of-archive and truncation.

``next_member`` parses headers up to the next regular file, optionally resynchronising past damage.
"""
from __future__ import annotations

import re
import zlib
from typing import Callable

from datapipe.tar.blocks import MmapReader, TarFormatError, TarTruncated
from datapipe.words import counted

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")


def split_key(name: str) -> tuple[str | None, str | None]:
    """webdataset's rule: the key is everything up to the first dot of the last path component."""
    m = _KEY_EXT.match(name)
    if not m:
        return None, None
    return m.group(1), m.group(2).lower()


def is_meta(name: str) -> bool:
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(_SKIP_META.match(name))


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
_GNU_SPARSE = b"S"
# entry types with no data of their own: refused where a sample member would be lost (as `datapipe index` does)
_NO_DATA = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
            b"6": "a FIFO"}


def _skip_sparse(reader, header: bytes, name: str, size: int, header_offset: int) -> TarFormatError:
    """Step over a sparse member (GNU, old GNU or pax) and return the error that refuses it."""
    key = split_key(name)[0]
    if header[156:157] == _GNU_SPARSE and header[482]:  # GNU: the sparse map goes on in extension blocks
        while True:
            block = reader.read(BLOCK)
            if block is None:
                raise TarTruncated(f"tar stream ends inside the sparse map of member {name!r}", header_offset, key)
            if not block[504]:
                break
    if not reader.skip(padded(size)):
        raise TarTruncated(f"tar stream ends inside member {name!r} ({size} bytes expected)", header_offset, key)
    err = TarFormatError(f"sparse tar members are not supported (member {name!r})", header_offset, key=key,
                         name=name)
    err.intact = True
    return err


def _refuse_kind(kind: str, name: str, target: str, header_offset: int) -> TarFormatError | None:
    """The error that refuses a member of a data-less kind (a link, a device) named like a sample's member, or
    None where no sample would have it (no extension, a ``__meta__`` name: skipped as a regular file would be)."""
    key = split_key(name)[0]
    if key is None or is_meta(name):
        return None
    to = f" to {target!r}" if target else ""
    err = TarFormatError(f"tar member {name!r} is {kind}{to}, not a regular file: its sample cannot be read "
                         "(write the shard from the files' contents, e.g. with datapipe.ShardWriter)",
                         header_offset, key=key, name=name)
    err.intact = True
    return err


_LOOKS = ((b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image"), (b"PK\x03\x04", "a zip archive"),
          (b"\x1f\x8b", "gzip-compressed data"),
          (b"%PDF", "a PDF document"), (b"RIFF", "a RIFF file (WebP, WAV, AVI)"), (b"GIF8", "a GIF image"))


def is_tar_header(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts with a tar header: a full block whose checksum holds."""
    return len(head) >= BLOCK and _checksum_ok(head[:BLOCK])


def looks_like(head: bytes) -> str:
    """What a file whose first block is no tar header seems to be, in words."""
    if 0 < len(head) < BLOCK and not head.startswith(tuple(m for m, _ in _LOOKS)):
        return f"{counted(len(head), 'byte')}, shorter than one tar header"
    for magic, what in _LOOKS:
        if head.startswith(magic):
            return f"it starts like {what}"
    text = head.rstrip(b"\0")
    if text and all(32 <= c < 127 or c in b"\t\r\n" for c in text[:256]):
        return "it starts like a text file"
    return "its first 512 bytes are not a tar header"


def next_member(reader, *, resync: bool = False, on_error: Callable[[TarFormatError], None] | None = None
                ) -> tuple[str, int, int] | None:
    """Parse headers up to the next regular file; returns ``(name, size, header_offset)`` or None at the end.

    The reader is left at the member's data; the caller must consume ``padded(size)`` bytes.
    Extension headers (GNU long names, pax ``path`` / ``size``) are applied; other entry types
    are skipped, but for links and devices named like a sample's member, which are refused as sparse
    members are (``TarFormatError`` with ``intact`` set; its member is stepped over). A bad header (checksum, size field, pax records, a size past the end of a file
    of known size) raises ``TarFormatError`` unless ``resync`` is set, in which case ``on_error``
    is told and the reader scans forward for the next valid header.
    """
    header_offset = reader.offset
    header = reader.peek(BLOCK)
    if header is not None:
        member = _plain_member(header, header_offset, getattr(reader, "size", None))
        if member is not None:
            reader.advance(BLOCK)
            return member
    return _next_member(reader, resync=resync, on_error=on_error)


def _plain_member(header: bytes, header_offset: int, limit: int | None) -> tuple[str, int, int] | None:
    """The common case, parsed in one step: a sound header of a regular file with no extension header
    before it and no name prefix. None for anything else (``_next_member`` then parses it the full way,
    with the same result for the headers this accepts)."""
    flag = header[156]
    if (flag != 48 and flag != 0) or header[345]:  # not '0' / NUL, or a ustar name prefix
        return None
    try:
        size = int(header[124:136].rstrip(b"\0 "), 8)
        stored = int(header[148:156].rstrip(b"\0 "), 8)
    except ValueError:
        return None
    if size < 0 or stored < 0 or (limit is not None and header_offset + BLOCK + size > limit):
        return None
    byte_sum = ((zlib.adler32(header) & 0xFFFF) - 1) % 65521  # as _checksum_ok
    if stored % 65521 != (byte_sum - sum(header[148:156]) + 256) % 65521:
        return None
    name = header[0:100].split(b"\0", 1)[0]
    if not name:
        return None
    return name.decode("utf-8", "surrogateescape"), size, header_offset


def _next_member(reader, *, resync: bool, on_error: Callable[[TarFormatError], None] | None
                 ) -> tuple[str, int, int] | None:
    """``next_member`` the full way: extension headers, other entry types, damage and resynchronisation."""
    long_name = long_link = None
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
            if header_offset == 0 and header[257:262] != b"ustar":
                raise TarTruncated(f"not a tar file: {looks_like(header)}", 0)
            err = TarFormatError("bad tar header checksum", header_offset, name=_legible_name(header))
        else:
            try:
                size = _octal(header[124:136])
                typeflag = header[156:157]
                if typeflag in _REGULAR or typeflag == _GNU_SPARSE:
                    if pax is not None:
                        name = pax.get("path") or long_name or _name(header)
                        if "size" in pax:
                            size = int(pax["size"]) if pax["size"].isdigit() else _bad_number(pax["size"])
                    else:
                        name = long_name or _name(header)
                    sparse = typeflag == _GNU_SPARSE or (pax is not None and any(k.startswith("GNU.sparse.")
                                                                                  for k in pax))
                    if sparse and pax is not None:
                        name = pax.get("GNU.sparse.name") or name  # pax 1.0 keeps the real name here
                    if limit is not None and header_offset + BLOCK + size > limit:
                        err = TarFormatError(f"tar member of {size} bytes runs past the end of the file "
                                             f"({limit} bytes)", header_offset, name=name)
                    elif sparse:
                        err = _skip_sparse(reader, header, name, size, header_offset)
                    else:
                        return name, size, header_offset
                elif typeflag in (b"L", b"x", b"K", b"g"):
                    if size > 1 << 24:
                        raise ValueError(f"tar extension header of {size} bytes is too large")
                    data = reader.read(padded(size))
                    if data is None:
                        raise TarFormatError("tar stream ends inside an extension header", header_offset)
                    if typeflag in (b"L", b"K"):
                        text = bytes(data[:size]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                        if typeflag == b"L":
                            long_name = text
                        else:
                            long_link = text
                    elif typeflag == b"x":
                        pax = _pax_records(bytes(data[:size]))
                    continue
                else:
                    # Other entry types hold no sample data. Directory entries (and GNU volume labels, unknown
                    # types) are skipped, as webdataset's tar iterator (it keeps `tarinfo.isreg()` members only)
                    # and DALI's wds2idx skip them. A link or device named like a sample's member is refused by
                    # name instead (webdataset would drop it silently, losing that file of its sample).
                    kind = _NO_DATA.get(typeflag)
                    if kind is not None:
                        name = (pax or {}).get("path") or long_name or _name(header)
                        target = ((pax or {}).get("linkpath") or long_link
                                  or header[157:257].split(b"\0", 1)[0].decode("utf-8", "surrogateescape"))
                        err = _refuse_kind(kind, name, target, header_offset)
                    long_name = long_link = pax = None
                    if not reader.skip(padded(size)):
                        raise TarFormatError("tar stream ends inside a non-file entry", header_offset)
                    if kind is None or err is None:
                        continue
            except ValueError as e:
                err = TarFormatError(f"bad tar header: {e}", header_offset, name=_legible_name(header))
        if not resync:
            raise err
        on_error(err)
        long_name = long_link = pax = None
        if not err.intact and not _resync(reader):  # an intact header's member was stepped over whole
            return None


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
        return TarTruncated(f"not a tar file: {counted(left, 'byte')}, shorter than one tar header", 0)
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
    drain = getattr(reader, "drain", None)
    if drain is not None:
        drain()


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
