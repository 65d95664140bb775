"""Opening shards on any storage: local files, fsspec URLs with retries, and opt-in ``pipe:``; compressed
shards are unwrapped by :mod:`datapipe.storage.compression`."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time

import fsspec

from datapipe.errors import DataError
from datapipe.storage.compression import REMOTE_BLOCK, decompress
from datapipe.storage.failures import (StorageError, describe, is_credential_error, is_missing,  # noqa: F401
                                       is_permanent, scrub, secrets_of, timeout_kind)  # (callers' names too)
from datapipe.storage.locations import is_local, local_path, redact_url, url_scheme

log = logging.getLogger("datapipe.storage.files")


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem that holds ``url`` and the path of ``url`` on it (``storage_options`` passed on).
    A protocol whose extra is not installed (s3:// without s3fs) raises ``datapipe.extras.MissingExtra``."""
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        from datapipe.extras import for_url

        raise for_url(url, e) from e


def write_json(url: str, obj, storage_options: dict | None = None, *, sort_keys: bool = False) -> bytes:
    """Write ``obj`` as JSON to ``url`` atomically (a temporary name, then rename); returns the bytes written."""
    data = (json.dumps(obj, indent=1, sort_keys=sort_keys) + "\n").encode()
    fs, path = filesystem(url, storage_options)
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)
    return data


DEFAULT_TIMEOUT = 60.0


def with_timeouts(url: str, storage_options: dict | None, timeout: float | None) -> dict:
    """``storage_options`` plus client timeouts for ``url``'s protocol, unless the caller set their own.

    HTTP(S): an ``aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)`` as
    ``client_kwargs["timeout"]``; S3: botocore's ``connect_timeout`` / ``read_timeout`` in
    ``config_kwargs``. A stalled server then raises a (retried) timeout instead of hanging.
    """
    options = dict(storage_options or {})
    if timeout is None:
        return options
    scheme = url_scheme(url)
    if scheme in ("http", "https"):
        client_kwargs = dict(options.get("client_kwargs") or {})
        if "timeout" not in client_kwargs:
            import aiohttp

            client_kwargs["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
            options["client_kwargs"] = client_kwargs
    elif scheme in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        options["config_kwargs"] = config
    return options


def read_timeout(url: str, storage_options: dict | None) -> float | None:
    """The read timeout that ``storage_options`` give ``url``'s client (as :func:`with_timeouts` sets it), or None."""
    options = storage_options or {}
    scheme = url_scheme(url)
    if scheme in ("http", "https"):
        timeout = (options.get("client_kwargs") or {}).get("timeout")
        values = [getattr(timeout, name, None) for name in ("sock_read", "total")]
    elif scheme in ("s3", "s3a"):
        values = [(options.get("config_kwargs") or {}).get("read_timeout")]
    else:
        return None
    return next((float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
                None)


def retry_call(fn, url: str, *, retries: int = 5, backoff: float = 0.2, max_backoff: float = 5.0,
               storage_options: dict | None = None, what: str = "shard"):
    """Call ``fn()``, retrying transient failures with exponential backoff; permanent ones pass through.

    ``what`` names ``url`` in the ``DataError`` (``"shard"``, ``"manifest"``...)."""
    failures = 0
    while True:
        try:
            return fn()
        except Exception as e:
            if is_credential_error(e):
                text, cause = describe(e, secrets_of(url, storage_options))
                raise DataError(f"no usable credentials: {text}", url=redact_url(url), what=what) from cause
            if is_permanent(e):
                raise
            failures += 1
            text, cause = describe(e, secrets_of(url, storage_options))
            if failures > retries:
                raise DataError(f"giving up after {retries} retries: {text}", url=redact_url(url),
                                what=what) from cause
            delay = min(max_backoff, backoff * 2 ** (failures - 1))
            log.warning("retrying %s in %.2fs after %s", redact_url(url), delay, text)
            time.sleep(delay)


class RetryingFile:
    """A read-only remote file that survives transient failures, within a bound.

    On a read error (5xx, connection reset, timeout) or a body shorter than the file's size, it
    reopens the URL, seeks to the byte it had reached and reads on, with exponential backoff.
    Bytes are never returned twice. It gives up with ``DataError`` after ``retries`` + 1 failures in
    a row with no byte between them, or once the time lost to failures (the failed attempts and the
    waits between them) exceeds ``(retries + 1) * timeout`` plus the time spent receiving bytes: a
    stall costs a timeout, and every ``timeout`` seconds of reading earns one back. ``timeout``
    defaults to the read timeout of ``storage_options`` (see :func:`with_timeouts`), else 60 s.

    HTTP(S) is read as one streaming GET: a resume (after a cut) or a long skip asks for
    ``Range: bytes=N-``; a server that ignores Range (``python -m http.server``) answers with the
    whole file, whose first N bytes are then read and dropped, so the bytes stay in order.
    """

    SKIP_BY_READING = REMOTE_BLOCK  # a streaming read skips up to this many bytes by reading them

    def __init__(self, url: str, *, storage_options: dict | None = None, retries: int = 5,
                 backoff: float = 0.2, max_backoff: float = 5.0, block_size: int = REMOTE_BLOCK,
                 timeout: float | None = None):
        self.url = url
        self.storage_options = storage_options or {}
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.block_size = block_size
        self.timeout = timeout or read_timeout(url, self.storage_options) or DEFAULT_TIMEOUT
        self.pos = 0
        self.retried = 0
        self._streak = 0           # failures since the last byte came
        self._lost_s = 0.0         # seconds lost to failures: failed attempts, reopens, backoff
        self._reading_s = 0.0      # seconds spent in reads that returned bytes
        self._body = 0             # bytes the open response has given so far
        self._secrets = secrets_of(url, self.storage_options)
        self._fs, self._path = filesystem(url, self.storage_options)
        self._f = None
        self.size: int | None = None
        self._streaming = url_scheme(url) in ("http", "https")
        self._at = 0               # streaming: the byte the open response is at
        self.ranges: bool | None = None  # streaming: whether the server honours Range (None: not asked yet)
        self._call(self._open)

    def _close_current(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except Exception:
                pass
            self._f = None

    def _open_stream(self) -> None:
        """One GET from ``pos`` on (``Range: bytes=pos-`` unless the server is known to ignore it)."""
        if self.size is None:
            size = self._fs.info(self._path).get("size")
            self.size = int(size) if isinstance(size, int) else None
        headers = dict(getattr(self._fs, "kwargs", {}).get("headers") or {})
        ask = self.pos > 0 and self.ranges is not False
        if ask:
            headers["Range"] = f"bytes={self.pos}-"
        f = self._fs.open(self._path, "rb", block_size=0, size=self.size, headers=headers)
        self._f, self._at, self._body = f, 0, 0
        response = getattr(f, "r", None)
        if ask and getattr(response, "status", 200) == 206:
            content_range = response.headers.get("Content-Range", "")
            if not content_range.startswith(f"bytes {self.pos}-"):
                raise OSError(f"asked for bytes {self.pos}- and got {content_range!r}")
            self.ranges, self._at = True, self.pos
        elif ask:
            if self.ranges is None:
                log.info("%s ignores Range requests: reading from the start and dropping %d bytes",
                         redact_url(self.url), self.pos)
            self.ranges = False
        self._reach()

    def _reach(self) -> None:
        """Bring the open stream to ``pos``: read ahead and drop the bytes before it."""
        while self._at < self.pos:
            data = self._f.read(min(self.pos - self._at, 1 << 20))
            if not data:
                raise EOFError(f"body ended at byte {self._at} of {self.size}")
            self._at += len(data)
            self._body += len(data)

    def _open(self):
        self._close_current()
        if self._streaming:
            return self._open_stream()
        f = self._fs.open(self._path, "rb", block_size=self.block_size, cache_type="none")
        if self.size is None:
            size = getattr(f, "size", None)
            self.size = int(size) if isinstance(size, int) else None
        if self.pos:
            f.seek(self.pos)
        self._f, self._body = f, 0

    def _call(self, fn, *args):
        reopen = False
        while True:
            started = time.monotonic()
            try:
                if reopen:
                    self._open()  # reopen at ``pos`` after a failure
                opened = time.monotonic()
                result = fn(*args)
            except Exception as e:  # transient: network errors, 5xx, timeouts, truncated bodies
                self._failed(e, time.monotonic() - started)
                reopen = True
                continue
            self._lost_s += opened - started  # a reopen is part of what a failure cost
            if isinstance(result, bytes) and result:
                self._reading_s += time.monotonic() - opened
                self._streak = 0
            return result

    def _failed(self, e: Exception, spent: float) -> None:
        """Count a failed attempt that took ``spent`` seconds; raise ``DataError`` past the bound, else back off."""
        text, cause = describe(e, self._secrets)
        if is_missing(e):  # not "FileNotFoundError: <the URL again>"
            raise DataError("the shard does not exist", url=redact_url(self.url)) from cause
        if is_permanent(e):
            raise DataError(f"cannot read shard: {text}", url=redact_url(self.url)) from cause
        text = self._what_happened(e, text, spent)
        self._streak += 1
        self.retried += 1
        self._lost_s += spent
        allowed = (self.retries + 1) * self.timeout + self._reading_s
        if self._streak > self.retries:
            raise DataError(f"cannot read shard after {self.retries} retries at byte {self.pos}: {text}",
                            url=redact_url(self.url)) from cause
        if self._lost_s >= allowed:
            raise DataError(f"cannot read shard: giving up at byte {self.pos} after {self.retried} failures that "
                            f"lost {self._lost_s:.1f} s, the most a shard may lose ((retries + 1) x timeout = "
                            f"{(self.retries + 1) * self.timeout:g} s, plus the {self._reading_s:.1f} s spent "
                            f"receiving bytes); last: {text}", url=redact_url(self.url)) from cause
        delay = min(self.max_backoff, self.backoff * 2 ** (self._streak - 1))
        log.warning("retrying %s at byte %d in %.2fs after %s", redact_url(self.url), self.pos, delay, text)
        time.sleep(delay)
        self._lost_s += delay

    def _what_happened(self, e: Exception, text: str, spent: float) -> str:
        """``text`` in words that say where the read failed: a stall or a cut mid-body, or no answer."""
        if isinstance(e, EOFError) or self._f is None:
            return text
        if not self._streaming:  # every read is a request of its own
            return f"stalled reading (no byte for {spent:.1f} s)" if timeout_kind(e) else text
        if timeout_kind(e):
            return f"stalled mid-body after {self._body} bytes of the response (no byte for {spent:.1f} s)"
        return f"cut mid-body after {self._body} bytes of the response: {text.removeprefix('cannot connect: ')}"

    def _read_once(self, n: int) -> bytes:
        if self._f is None:
            self._open()
        elif self._streaming and self._at != self.pos:
            if self.pos < self._at or (self.pos - self._at > self.SKIP_BY_READING and self.ranges is not False):
                self._open()  # back, or far ahead where Range works: a new request
            else:
                self._reach()
        data = self._f.read(n)
        if not data and self.size is not None and self.pos < self.size:
            self._f = None
            raise EOFError(f"body ended at byte {self.pos} of {self.size}")
        self._at += len(data)
        self._body += len(data)
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
        if self._f is not None and not self._streaming:  # a stream moves on its next read
            self._call(self._seek_once)
        return pos

    def _seek_once(self) -> None:
        self._f.seek(self.pos)

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


def open_shard(url: str, *, storage_options: dict | None = None, retries: int = 5, allow_pipe: bool = False,
               backoff: float = 0.2):
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
        raw, seekable = RetryingFile(url, storage_options=storage_options, retries=retries, backoff=backoff), True
    return decompress(url, raw, seekable=seekable)
