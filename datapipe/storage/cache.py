"""A node-local cache of remote shards: fetched once, then served from local disk (memory-mapped).

Layout of the cache directory (shared by every process of a node):

- ``<hash>-<shard name>``: a cached shard (written under a temporary name, then renamed);
- ``datapipe-cache.json``: the index of the files the cache wrote (name -> url, bytes, inode,
  mtime, sha256), rewritten atomically under ``datapipe-cache.lock``;
- ``.<name>.lock``: held by the one process that fetches a shard.

Eviction is least-recently-used (a hit sets the file's access time) and deletes only files that the
index lists with the same inode and size, so files the cache did not write are never touched.

A cached file whose inode, size or modification time differs from its index entry has changed
since it was written: with a known sha256 it is hashed (served if it still matches, its entry
stamped anew), else it is fetched again. A cache that cannot write (a full disk, no permission)
costs only its entries: the shard is read from storage, the first failure is logged as a warning,
and every failure is counted (``failures``; ``ShardStream.stats()["cache_failures"]``).

A shard without a known checksum is written to the cache *while* it is parsed (a tee), so the
first epoch waits for no download; the rest of the shard is fetched after the last sample that
this reader needed. A shard whose manifest gives a sha256 is fetched whole and verified before
any sample is read (a mismatch is fetched once more, then ``DataError``). If another process is
already fetching a shard, a streaming reader reads it remotely instead of waiting for it (a wait
could deadlock ranks of one node that wait for each other in collectives).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from typing import Any, Callable

import filelock

from datapipe.errors import DataError
from datapipe.storage.urls import redact_text, redact_url

log = logging.getLogger("datapipe.storage.cache")

INDEX_NAME = "datapipe-cache.json"
LOCK_NAME = "datapipe-cache.lock"
TMP_PREFIX = ".datapipe-tmp-"
FORMAT = "datapipe-cache"
CHUNK = 8 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ShardCache:
    """Remote shards cached in ``directory`` (local), at most ``limit`` bytes in all (None: no limit)."""

    def __init__(self, directory: str, *, limit: int | None = None, lock_timeout: float = 600.0):
        if "://" in str(directory) and not str(directory).startswith("file://"):
            raise ValueError(f"cache_dir must be a local directory, got {directory!r}")
        if limit is not None and limit <= 0:
            raise ValueError(f"cache_limit must be a positive number of bytes (or None for no limit), got {limit}")
        self.directory = os.path.abspath(str(directory)[len("file://"):] if str(directory).startswith("file://")
                                         else str(directory))
        self.limit = limit
        self.lock_timeout = lock_timeout
        self._index_memo: tuple[Any, dict] | None = None
        self.failures = 0  # shards that could not be cached here (full disk, no permission...)
        self._warned = False

    # ---- names and the index ------------------------------------------------------------------
    def name_for(self, url: str) -> str:
        """The cache file name of ``url``: a hash of the whole URL plus its readable shard name."""
        digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:24]
        base = url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1] or "shard"
        return f"{digest}-{_UNSAFE.sub('_', base)[-100:]}"

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _dir_lock(self) -> filelock.BaseFileLock:
        os.makedirs(self.directory, exist_ok=True)
        return filelock.FileLock(self._path(LOCK_NAME), timeout=self.lock_timeout, thread_local=False)

    def _shard_lock(self, name: str) -> filelock.BaseFileLock:
        os.makedirs(self.directory, exist_ok=True)
        return filelock.FileLock(self._path(f".{name}.lock"), timeout=self.lock_timeout, thread_local=False)

    def read_index(self) -> dict:
        path = self._path(INDEX_NAME)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return {"format": FORMAT, "version": 1, "entries": {}}
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._index_memo is not None and self._index_memo[0] == stamp:
            return self._index_memo[1]
        try:
            with open(path) as f:
                index = json.load(f)
            if index.get("format") != FORMAT or not isinstance(index.get("entries"), dict):
                raise ValueError("not a datapipe cache index")
        except (OSError, ValueError) as e:
            log.warning("cache index %s is unreadable (%s): starting an empty one; files it listed are kept",
                        path, e)
            index = {"format": FORMAT, "version": 1, "entries": {}}
        self._index_memo = (stamp, index)
        return index

    def _write_index(self, index: dict) -> None:
        tmp = self._path(f"{TMP_PREFIX}{INDEX_NAME}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=0, sort_keys=True)
        os.replace(tmp, self._path(INDEX_NAME))
        self._index_memo = None

    def _owned(self, name: str, entry: dict) -> os.stat_result | None:
        """The file's stat if it is still the very file the cache wrote under ``name``."""
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            return None
        if st.st_ino != entry.get("ino") or st.st_size != entry.get("bytes"):
            return None
        return st

    @staticmethod
    def _unchanged(st: os.stat_result, entry: dict) -> bool:
        """Whether the file is as the cache wrote it: inode, size and modification time as recorded."""
        return (st.st_ino, st.st_size, st.st_mtime_ns) == (entry.get("ino"), entry.get("bytes"), entry.get("mtime_ns"))

    def cached_bytes(self) -> int:
        return sum(int(e["bytes"]) for e in self.read_index()["entries"].values())

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, url: str, *, sha256: str | None = None) -> str | None:
        """The local path of ``url``'s cached copy (and mark it recently used), or None.

        A copy that changed since the cache wrote it (inode, size or mtime) is served only if its
        sha256 (``sha256``, else the one recorded) still matches; otherwise it is dropped (None).
        """
        name = self.name_for(url)
        entry = self.read_index()["entries"].get(name)
        if entry is None:
            return None
        path = self._path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if not self._unchanged(st, entry) and not self._still_good(url, name, st, sha256 or entry.get("sha256")):
            return None
        try:
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # recency in the access time; mtime stays the stamp
        except OSError:
            pass
        return path

    def _still_good(self, url: str, name: str, st: os.stat_result, sha256: str | None) -> bool:
        """A changed cached file: keep it (stamped anew) if it still has ``sha256``, else drop it."""
        good = bool(sha256) and _file_sha256(self._path(name)) == sha256.lower()
        try:
            with self._dir_lock():
                index = self.read_index()
                entry = index["entries"].get(name)
                if entry is not None:
                    if good:
                        entry.update(ino=st.st_ino, bytes=st.st_size, mtime_ns=st.st_mtime_ns)
                    else:
                        del index["entries"][name]
                        if st.st_ino == entry.get("ino"):  # the cache's own file, changed in place
                            _remove(self._path(name))
                    self._write_index(index)
        except (OSError, filelock.Timeout) as e:
            self.failed(url, e)
        if not good:
            log.warning("cache: %s changed on disk since it was cached%s: fetching it again", self._path(name),
                        " and no longer matches its sha256" if sha256 else "")
        return good

    def failed(self, url: str, err: BaseException) -> None:
        """Count a cache failure (the shard is read from storage instead); the first one is logged as a warning."""
        self.failures += 1
        (log.debug if self._warned else log.warning)(
            "cache %s cannot keep %s (%s: %s): reading from storage instead; failures are counted in "
            "stats()['cache_failures']", self.directory, redact_url(url), type(err).__name__, redact_text(err))
        self._warned = True

    def open(self, url: str, open_remote: Callable[[], Any], *, sha256: str | None = None):
        """A raw file of ``url``: the cached copy, a verified fresh copy, or the remote file teed into the cache.

        Returns ``(file, hit)``. A teed file has ``finish()``: call it after a successful read to
        fetch the rest and commit the shard; ``close()`` without it discards the partial copy.
        """
        try:
            return self._open(url, open_remote, sha256=sha256)
        except (OSError, filelock.Timeout) as e:  # the cache cannot write (full disk, no permission): read through
            self.failed(url, e)
            return open_remote(), False

    def _open(self, url: str, open_remote: Callable[[], Any], *, sha256: str | None):
        path = self.lookup(url, sha256=sha256)
        if path is not None:
            try:
                return open(path, "rb", buffering=0), True
            except FileNotFoundError:  # evicted by another process just now
                pass
        if sha256:
            return self._fetch_verified(url, open_remote, sha256), False
        name = self.name_for(url)
        lock = self._shard_lock(name)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return open_remote(), False  # another process is fetching it: read it remotely this time
        try:
            path = self.lookup(url)  # fetched by another process since our lookup
            if path is not None:
                lock.release()
                return open(path, "rb", buffering=0), True
            remote = open_remote()
            try:
                return TeeFile(self, url, name, remote, lock), False
            except OSError:
                remote.close()
                raise
        except BaseException:
            if lock.is_locked:
                lock.release()
            raise

    # ---- writing ------------------------------------------------------------------------------
    def _temp_path(self, name: str) -> str:
        return self._path(f"{TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def _fetch_verified(self, url: str, open_remote: Callable[[], Any], sha256: str):
        name = self.name_for(url)
        with self._shard_lock(name):
            path = self.lookup(url)
            if path is not None:
                return open(path, "rb", buffering=0)
            for attempt in range(2):
                tmp = self._temp_path(name)
                digest = hashlib.sha256()
                remote = open_remote()
                try:
                    with open(tmp, "wb") as out:
                        while True:
                            chunk = remote.read(CHUNK)
                            if not chunk:
                                break
                            digest.update(chunk)
                            out.write(chunk)
                except OSError:
                    _remove(tmp)
                    raise
                finally:
                    remote.close()
                if digest.hexdigest() == sha256.lower():
                    return self._commit_or_keep(url, name, tmp, sha256)
                _remove(tmp)
                log.warning("sha256 of %s does not match its manifest%s", redact_url(url),
                            ": fetching it once more" if attempt == 0 else "")
        raise DataError("shard's sha256 does not match the manifest (fetched twice)", url=redact_url(url))

    def _commit_or_keep(self, url: str, name: str, tmp: str, sha256: str | None):
        """Commit ``tmp`` into the cache and open it; if it cannot be cached, open it and delete its name."""
        try:
            path = self.commit(url, name, tmp, sha256=sha256)
        except (OSError, filelock.Timeout) as e:
            self.failed(url, e)
            path = None
        if path is not None:
            return open(path, "rb", buffering=0)
        f = open(tmp, "rb", buffering=0)
        _remove(tmp)  # the open file stays readable
        return f

    def commit(self, url: str, name: str, tmp: str, *, sha256: str | None = None) -> str | None:
        """Move a complete temporary file into the cache (evicting LRU entries); None if it cannot be cached."""
        size = os.path.getsize(tmp)
        if self.limit is not None and size > self.limit:
            log.info("shard %s (%d bytes) is larger than the cache limit (%d): not cached",
                     redact_url(url), size, self.limit)
            return None
        with self._dir_lock():
            index = self.read_index()
            entries = index["entries"]
            final = self._path(name)
            if name not in entries and os.path.lexists(final):
                log.warning("cache: %s exists but the cache did not write it: leaving it alone", final)
                return None
            entries.pop(name, None)
            self._evict(entries, need=size)
            os.replace(tmp, final)
            st = os.stat(final)
            entries[name] = {"url": redact_url(url), "bytes": size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns,
                             "sha256": sha256}
            self._write_index(index)
        return final

    def _evict(self, entries: dict, *, need: int) -> None:
        """Delete least recently used cached shards until ``need`` more bytes fit under the limit."""
        if self.limit is None:
            return
        live = []
        for name, entry in list(entries.items()):
            st = self._owned(name, entry)
            if st is None:
                del entries[name]  # gone or replaced by someone else's file: forget it, never delete it
            else:
                live.append((st.st_atime_ns, name))
        total = sum(int(entries[n]["bytes"]) for _, n in live)
        for _, name in sorted(live):
            if total + need <= self.limit:
                break
            _remove(self._path(name))
            total -= int(entries.pop(name)["bytes"])
            log.info("cache: evicted %s", name)


class TeeFile:
    """A remote shard read sequentially while every byte is also written to a temporary cache file."""

    def __init__(self, cache: ShardCache, url: str, name: str, remote, lock: filelock.BaseFileLock):
        self.cache = cache
        self.url = url
        self.name = name
        self.remote = remote
        self.lock = lock
        self.tmp = cache._temp_path(name)
        self.out = open(self.tmp, "wb")
        self.written = 0
        self.committed = False

    @property
    def retried(self) -> int:
        return getattr(self.remote, "retried", 0)

    def read(self, n: int = -1) -> bytes:
        data = self.remote.read(n)
        if data and self.out is not None:
            try:
                self.out.write(data)
            except OSError as e:  # the cache's disk is full: the read goes on, only the cache entry is lost
                self._give_up(e)
            else:
                self.written += len(data)
        return data

    def _give_up(self, err: BaseException) -> None:
        try:
            self.out.close()
        except OSError:
            pass
        self.out = None
        _remove(self.tmp)
        self.cache.failed(self.url, err)

    def seekable(self) -> bool:
        return False

    def finish(self) -> None:
        """Fetch the rest of the shard and commit it; a failure only costs the cache entry (logged)."""
        if self.committed or self.out is None:
            return
        try:
            while self.out is not None and self.read(CHUNK):
                pass
            if self.out is None:  # the write failed on the way (counted): nothing to commit
                return
            size = getattr(self.remote, "size", None)
            if size is not None and self.written != size:
                raise DataError(f"got {self.written} of {size} bytes", url=redact_url(self.url))
            self.out.close()
            self.out = None
            self.committed = self.cache.commit(self.url, self.name, self.tmp) is not None
        except (OSError, DataError, filelock.Timeout) as e:
            self.cache.failed(self.url, e)

    def close(self) -> None:
        if self.out is not None:
            try:
                self.out.close()
            except OSError:
                pass
            self.out = None
        if not self.committed:
            _remove(self.tmp)
        try:
            self.remote.close()
        finally:
            if self.lock.is_locked:
                self.lock.release()


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
