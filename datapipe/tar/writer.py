"""``ShardWriter``: WebDataset tar shards written atomically, with a manifest of counts and checksums."""
from __future__ import annotations

import hashlib
import posixpath
import tarfile
import uuid
from typing import Any

import fsspec

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


class _PlainTar:
    """An uncompressed tar in webdataset's layout (``TarWriter``'s member attributes), written in one pass.

    Headers come from :meth:`tarfile.TarInfo.tobuf`; each header and value is written and hashed
    once (no copy through tarfile's 10 KiB stream buffer), so the sha256 costs no second pass.
    """

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0
        self._encoder = None

    def _out(self, data) -> None:
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
            info = tarfile.TarInfo(f"{key}.{k}")
            info.size, info.mtime, info.mode, info.uname, info.gname = len(v), 0, 0o444, "bigdata", "bigdata"
            short = len(info.name) <= 100 and info.name.isascii()  # then PAX writes this very ustar header
            self._out(info.tobuf(tarfile.USTAR_FORMAT if short else tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            self._out(v)
            if len(v) % 512:
                self._out(bytes(512 - len(v) % 512))

    def close(self) -> None:
        """The two end-of-archive blocks, padded to tarfile's record size (as tarfile writes them)."""
        end = 2 * tarfile.BLOCKSIZE
        self._out(bytes(end + (-(self.nbytes + end)) % tarfile.RECORDSIZE))


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
        size = sum(512 + (len(v) + 511) // 512 * 512 for k, v in sample.items()
                   if not k.startswith("_") and hasattr(v, "__len__"))
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
        self._estimate = 0

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
