"""``ShardWriter``: WebDataset tar shards written atomically, with a manifest of counts and checksums."""
from __future__ import annotations

import hashlib
import posixpath
import queue
import tarfile
import threading
import uuid
from typing import Any

import fsspec

from datapipe.tar import member_table
from datapipe.tar.manifest import make_manifest, read_manifest, write_manifest


class _HashingFile:
    """A write-only file wrapper that counts bytes and computes their sha256."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.nbytes += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _ustar_template() -> tuple[bytes, bytes, int]:
    """The parts of a member header that every member shares (mode 0o444, uid / gid 0, mtime 0, owner
    ``bigdata``), taken from :meth:`tarfile.TarInfo.tobuf`: bytes 100-124, bytes 136-512 with the checksum
    field as spaces, and their byte sum."""
    info = tarfile.TarInfo("x")
    info.size, info.mtime, info.mode, info.uname, info.gname = 0, 0, 0o444, "bigdata", "bigdata"
    block = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    head, tail = block[100:124], block[136:148] + b" " * 8 + block[156:]
    return head, tail, sum(head) + sum(tail)


_HEAD, _TAIL, _FIXED_SUM = _ustar_template()
_MAX_USTAR_SIZE = 8 ** 11  # an 11-digit octal size field


def _member_header(name: str, size: int) -> bytes:
    """The ustar header of a member, byte for byte what ``TarInfo.tobuf`` writes for it (``_PlainTar``'s
    attributes): built from the shared template for the common case, by ``tarfile`` for the others
    (non-ASCII or long names, which get a pax header, and sizes past the ustar field)."""
    raw = name.encode("ascii") if len(name) <= 100 and name.isascii() else None
    if raw is None or size >= _MAX_USTAR_SIZE:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o444, "bigdata", "bigdata"
        return info.tobuf(tarfile.USTAR_FORMAT if raw is not None else tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    size_field = b"%011o\0" % size
    chksum = _FIXED_SUM + sum(raw) + sum(size_field)
    block = b"".join((raw, bytes(100 - len(raw)), _HEAD, size_field, _TAIL))
    return block[:148] + b"%06o\0" % chksum + block[155:]


class _BackgroundSha256:
    """A sha256 fed from a thread of its own, so that hashing a shard overlaps writing it (hashlib lets go of
    the GIL while it hashes a large buffer). ``update`` takes bytes (which cannot change after); they go to the
    thread in batches of ``batch`` bytes, at most ``depth`` batches waiting, so memory stays bounded when the
    hash falls behind."""

    def __init__(self, *, batch: int = 4 << 20, depth: int = 4):
        self._sha = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._digest: str | None = None
        self._batch, self._pending, self._pending_bytes = batch, [], 0

    def _run(self) -> None:
        update = self._sha.update
        while True:
            parts = self._queue.get()
            if parts is None:
                return
            for data in parts:
                update(data)

    def update(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= self._batch:
            self._send()

    def _send(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="datapipe-shard-sha256", daemon=True)
            self._thread.start()
        self._queue.put(self._pending)
        self._pending, self._pending_bytes = [], 0

    def stop(self) -> None:
        """Hash what was given, and end the thread (also when the shard is dropped)."""
        if self._pending:
            self._send()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def hexdigest(self) -> str:
        if self._digest is None:
            self.stop()
            self._digest = self._sha.hexdigest()
        return self._digest


class _PlainTar:
    """An uncompressed tar in webdataset's layout (``TarWriter``'s member attributes), written in one pass.

    Headers are byte for byte :meth:`tarfile.TarInfo.tobuf`'s (:func:`_member_header`); each header and
    value is written once (no copy through tarfile's 10 KiB stream buffer) and hashed as it is written, in a
    thread of its own, so the sha256 costs no second pass. The last member is the shard's member table
    (:mod:`datapipe.tar.member_table`): where each value lies, so that a local read needs no header walk.
    """

    def __init__(self, f):
        self._f = f
        self.sha256 = _BackgroundSha256()
        self.nbytes = 0
        self._encoder = None
        self._table = member_table.TableBuilder()

    def _out(self, data) -> None:
        if not isinstance(data, bytes):
            data = bytes(data)  # a bytearray or memoryview could change after this call returns
        self.sha256.update(data)
        self._f.write(data)
        self.nbytes += len(data)

    def write(self, sample: dict[str, Any]) -> None:
        if any(not isinstance(v, (bytes, bytearray, memoryview, str)) for k, v in sample.items() if k[0] != "_"):
            if self._encoder is None:  # other values: webdataset's encoding rules (imported only when needed)
                from webdataset.writer import make_encoder

                self._encoder = make_encoder(True)
            sample = self._encoder(sample)
        key = sample["__key__"]
        for k in sorted(sample):
            if k[0] == "_":
                continue
            v = sample[k]
            if isinstance(v, str):
                v = v.encode("utf-8")
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} of sample {key!r} doesn't map to bytes after encoding ({type(v).__name__})")
            size = v.nbytes if isinstance(v, memoryview) else len(v)
            name = f"{key}.{k}"
            self._out(_member_header(name, size))
            self._table.add(name, self.nbytes, size)
            self._out(v)
            if size % 512:
                self._out(bytes(512 - size % 512))

    def close(self) -> None:
        """The member table, then the two end-of-archive blocks, padded to tarfile's record size (as tarfile
        writes them)."""
        table = self._table.blob(self.nbytes)
        if table is not None:
            self._out(_member_header(member_table.NAME, len(table)))
            self._out(table)
        end = 2 * tarfile.BLOCKSIZE
        self._out(bytes(end + (-(self.nbytes + end)) % tarfile.RECORDSIZE))

    def abort(self) -> None:
        self.sha256.stop()


def _check_key(key: str) -> None:
    """A ValueError for a key that readers would split elsewhere: they end the key at the first dot of the
    member name's last path component (webdataset's rule), so ``a.b`` with ``jpg`` would read as key ``a``
    with extension ``b.jpg``."""
    if "\0" in key:
        raise ValueError(f"sample key {key!r} holds a NUL character: a tar member's name ends at its first NUL, so "
                         "readers would see another name")
    last = key.rsplit("/", 1)[-1]
    if not last or "." in last:
        raise ValueError(f"sample key {key!r} {'ends in a slash' if not last else 'holds a dot in its last part'}: "
                         "readers take the key to end at the member name's first dot after the last '/' "
                         "(webdataset's rule), so its values would be read under another key and extension; "
                         "replace the dots (e.g. with '_'), as `datapipe shard` does")


def _check_extension(key: str, ext: str) -> None:
    """A ValueError for an extension readers would not read back: one with a NUL (a member's name ends there) or
    a slash (the name's last path component would no longer be ``key.ext``: another key, or a hidden file)."""
    for bad, why in (("\0", "a NUL character: a tar member's name ends at its first NUL"),
                     ("/", "a slash: readers split a member's name at its last '/'")):
        if bad in ext:
            raise ValueError(f"extension {ext!r} of sample {key!r} holds {why}, so its value would be read under "
                             "another name or not at all")


def _header_bytes(name: str) -> int:
    """At most what a member's header takes: one block, three where a pax header carries a long or non-ASCII name."""
    return 512 if len(name) <= 100 and name.isascii() else 1536


def _tar_size(member_bytes: int) -> int:
    """A tar's size on disk: members, two end-of-archive blocks, rounded up to tarfile's record size."""
    return -(-(member_bytes + 1024) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class ShardWriter:
    """Write samples into shards named by ``pattern`` (e.g. ``out/shard-%06d.tar``).

    A new shard starts when the current one would exceed ``max_bytes`` or holds ``max_count``
    samples. Each shard is written under a temporary name and renamed when complete, so a reader
    never sees a partial shard. On close, ``<dir>/manifest.json`` lists every shard written by
    this writer (merged with the entries of shards of other names already listed there).
    ``index=True`` also writes DALI index files (``<shard>.idx``) next to the shards.
    """

    def __init__(
        self,
        pattern: str,
        *,
        max_bytes: int = 1 << 30,
        max_count: int = 100_000,
        start_shard: int = 0,
        index: bool = False,
        manifest: bool = True,
        compress: bool | None = None,
        storage_options: dict | None = None,
    ):
        if "%" not in pattern:
            raise ValueError(f"pattern {pattern!r} needs a shard number placeholder, e.g. 'out/shard-%06d.tar'")
        if max_bytes <= 0 or max_count <= 0:
            raise ValueError("max_bytes and max_count must be positive")
        self.pattern = pattern
        self.max_bytes = int(max_bytes)
        self.max_count = int(max_count)
        self.index = index
        self.write_manifest = manifest
        self.compress = pattern.endswith((".tgz", ".tar.gz")) if compress is None else compress
        self.storage_options = storage_options or {}
        self.fs, _ = fsspec.core.url_to_fs(pattern % 0, **self.storage_options)
        self.directory = posixpath.dirname(pattern % 0)
        self.shard_number = start_shard
        self.shards: list[dict[str, Any]] = []
        self.total = 0
        self._writer = None
        self._file = None
        self._hasher = None
        self._tmp = None
        self._final = None
        self._count = 0
        self._closed = False
        if self.directory:
            self.fs.makedirs(self._path(self.directory), exist_ok=True)

    def _path(self, url: str) -> str:
        return fsspec.core.url_to_fs(url, **self.storage_options)[1]

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, sample: dict[str, Any]) -> None:
        """Add one sample: ``__key__`` plus one value per extension (bytes, str, or encodable)."""
        if self._closed:
            raise ValueError("ShardWriter is closed")
        if "__key__" not in sample:
            raise ValueError("a sample needs a '__key__' entry")
        _check_key(str(sample["__key__"]))
        key = str(sample["__key__"])
        values = [k for k in sample if not k.startswith("_")]  # (a value without a length, a number, takes a block)
        for ext in values:
            _check_extension(key, ext)
        size = sum(_header_bytes(f"{key}.{k}") + (len(v) + 511 if hasattr(v := sample[k], "__len__") else 512)
                   // 512 * 512 for k in values)
        if not self.compress:  # what the sample adds to the shard's member table, at most
            size += member_table.bytes_for(key, values)
        if self._writer is not None and (
            self._count >= self.max_count or (self._count > 0 and _tar_size(self._estimate + size) > self.max_bytes)
        ):
            self._finish_shard()
        if self._writer is None:
            self._start_shard()
        self._estimate += size
        self._writer.write(sample)
        self._count += 1
        self.total += 1

    def _start_shard(self) -> None:
        self._final = self.pattern % self.shard_number
        self._tmp = f"{self._final}.tmp-{uuid.uuid4().hex[:8]}"
        self._file = self.fs.open(self._path(self._tmp), "wb")
        if self.compress:
            import webdataset

            self._hasher = _HashingFile(self._file)
            self._writer = webdataset.TarWriter(self._hasher, compress=True, mtime=0)  # int: no pax header per member
        else:
            self._writer = self._hasher = _PlainTar(self._file)
        self._count = 0
        self._estimate = 0 if self.compress else member_table.FIXED_BYTES

    def _finish_shard(self) -> None:
        self._writer.close()
        self._file.close()
        self.fs.mv(self._path(self._tmp), self._path(self._final))
        self.shards.append(
            {
                "name": posixpath.basename(self._final),
                "count": self._count,
                "bytes": self._hasher.nbytes,
                "sha256": self._hasher.sha256.hexdigest(),
            }
        )
        if self.index:
            from datapipe.tar.dali_index import write_dali_index

            write_dali_index(self._final)
        self._writer = self._file = self._hasher = self._tmp = None
        self.shard_number += 1

    def abort(self) -> None:
        """Drop the shard in progress (its temporary file is removed); finished shards stay."""
        if self._writer is not None:
            if isinstance(self._writer, _PlainTar):
                self._writer.abort()
            tar = getattr(self._writer, "tarstream", None)  # keep tarfile from writing its end blocks later
            if tar is not None:
                tar.closed = True
                if hasattr(tar.fileobj, "closed"):
                    tar.fileobj.closed = True
            try:
                self._file.close()
                self.fs.rm(self._path(self._tmp))
            except OSError:
                pass
            self._writer = None
        self._closed = True

    def close(self) -> None:
        """Finish the current shard and write the manifest."""
        if self._closed:
            return
        if self._writer is not None and self._count > 0:
            self._finish_shard()
        elif self._writer is not None:
            self.abort()
        self._closed = True
        if self.write_manifest and self.shards:
            previous = read_manifest(self.directory, storage_options=self.storage_options) or {"shards": []}
            mine = {s["name"] for s in self.shards}
            merged = [s for s in previous["shards"] if s["name"] not in mine] + self.shards
            write_manifest(self.directory, make_manifest(merged), storage_options=self.storage_options)
