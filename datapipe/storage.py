"""Opening shards on any storage: local files, fsspec URLs with retries, gzip, and opt-in ``pipe:``."""
from __future__ import annotations

import gzip
import logging
import shlex
import subprocess
import time

import fsspec

from datapipe.errors import DataError
from datapipe.urls import is_local, local_path, redact_url

log = logging.getLogger("datapipe.storage")

REMOTE_BLOCK = 8 << 20
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, NotImplementedError, ValueError)


def retry_call(fn, url: str, *, retries: int = 5, backoff: float = 0.2, max_backoff: float = 5.0):
    """Call ``fn()``, retrying transient failures with exponential backoff; permanent ones pass through."""
    failures = 0
    while True:
        try:
            return fn()
        except _PERMANENT:
            raise
        except Exception as e:
            failures += 1
            if failures > retries:
                raise DataError(f"giving up after {retries} retries: {type(e).__name__}: {e}", url=redact_url(url)) from e
            delay = min(max_backoff, backoff * 2 ** (failures - 1))
            log.warning("retrying %s in %.2fs after %s: %s", redact_url(url), delay, type(e).__name__, e)
            time.sleep(delay)


class RetryingFile:
    """A read-only remote file that survives transient failures.

    On a read error (5xx, connection reset, timeout) or a body shorter than the file's size, it
    reopens the URL, seeks to the byte it had reached and reads on, with exponential backoff.
    Bytes are never returned twice. After ``retries`` failures in a row it raises ``DataError``.
    """

    def __init__(self, url: str, *, storage_options: dict | None = None, retries: int = 5,
                 backoff: float = 0.2, max_backoff: float = 5.0, block_size: int = REMOTE_BLOCK):
        self.url = url
        self.storage_options = storage_options or {}
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.block_size = block_size
        self.pos = 0
        self.retried = 0
        self._fs, self._path = fsspec.core.url_to_fs(url, **self.storage_options)
        self._f = None
        self.size: int | None = None
        self._call(self._open)

    def _open(self):
        if self._f is not None:
            try:
                self._f.close()
            except Exception:
                pass
            self._f = None
        f = self._fs.open(self._path, "rb", block_size=self.block_size, cache_type="none")
        if self.size is None:
            size = getattr(f, "size", None)
            self.size = int(size) if isinstance(size, int) else None
        if self.pos:
            f.seek(self.pos)
        self._f = f

    def _call(self, fn, *args):
        failures = 0
        while True:
            try:
                return fn(*args)
            except _PERMANENT as e:
                raise DataError(f"cannot read shard: {type(e).__name__}: {e}", url=redact_url(self.url)) from e
            except Exception as e:  # transient: network errors, 5xx, timeouts, truncated bodies
                failures += 1
                self.retried += 1
                if failures > self.retries:
                    raise DataError(
                        f"cannot read shard after {self.retries} retries at byte {self.pos}: {type(e).__name__}: {e}",
                        url=redact_url(self.url),
                    ) from e
                delay = min(self.max_backoff, self.backoff * 2 ** (failures - 1))
                log.warning("retrying %s at byte %d in %.2fs after %s: %s", redact_url(self.url), self.pos,
                            delay, type(e).__name__, e)
                time.sleep(delay)
                try:
                    self._open()
                except _PERMANENT:
                    raise
                except Exception:
                    continue

    def _read_once(self, n: int) -> bytes:
        if self._f is None:
            self._open()
        data = self._f.read(n)
        if not data and self.size is not None and self.pos < self.size:
            self._f = None
            raise EOFError(f"body ended at byte {self.pos} of {self.size}")
        return data

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = (self.size - self.pos) if self.size is not None else 1 << 62
        if self.size is not None:
            n = min(n, self.size - self.pos)
        if n <= 0:
            return b""
        data = self._call(self._read_once, n)
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 1:
            pos += self.pos
        elif whence == 2:
            if self.size is None:
                raise OSError("cannot seek from the end of a file of unknown size")
            pos += self.size
        self.pos = pos
        if self._f is not None:
            self._call(self._f.seek, pos)
        return pos

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class PipeFile:
    """The standard output of a shell command (``pipe:cmd``), checked for a non-zero exit status."""

    def __init__(self, url: str):
        self.url = url
        self.proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE)

    def read(self, n: int = -1) -> bytes:
        data = self.proc.stdout.read(n)
        if not data:
            rc = self.proc.wait(timeout=60)
            if rc != 0:
                raise DataError(f"pipe command exited with status {rc}", url=redact_url(self.url))
        return data

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.proc.stdout.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


def is_gzip(url: str) -> bool:
    return url.endswith((".gz", ".tgz"))


def open_shard(url: str, *, storage_options: dict | None = None, retries: int = 5, allow_pipe: bool = False):
    """Open a shard for sequential reading; returns ``(file, seekable)``. Raises ``DataError``."""
    if url.startswith("pipe:"):
        if not allow_pipe:
            raise ValueError(f"pipe: URLs are refused: {redact_url(url)!r}; pass allow_pipe=True to allow them")
        raw, seekable = PipeFile(url), False
    elif is_local(url):
        try:
            raw = open(local_path(url), "rb", buffering=0)
        except OSError as e:
            raise DataError(f"cannot open shard: {type(e).__name__}: {e.strerror or e}", url=redact_url(url)) from e
        seekable = True
    else:
        raw, seekable = RetryingFile(url, storage_options=storage_options, retries=retries), True
    if is_gzip(url):
        gz = gzip.GzipFile(fileobj=raw, mode="rb")
        gz.myfileobj = raw  # closed together with the gzip reader
        return gz, False
    return raw, seekable
