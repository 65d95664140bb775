from datapipe.storage.files import is_missing, is_permanent


class ResponseError(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


def raised(outer, cause):
    try:
        try:
            raise cause
        except Exception as c:
            raise outer from c
    except Exception as e:
        return e


def test_permanent_errors_caused_by_a_server_error_are_transient():
    """fsspec's HTTP filesystem turns a 503 on its metadata request into FileNotFoundError."""
    assert is_permanent(FileNotFoundError("gone"))
    assert is_permanent(raised(FileNotFoundError("gone"), ResponseError(404)))
    assert not is_permanent(raised(FileNotFoundError("x"), ResponseError(503)))
    assert not is_permanent(raised(FileNotFoundError("x"), ResponseError(429)))
    assert not is_permanent(raised(FileNotFoundError("x"), ConnectionResetError("reset")))
    assert not is_permanent(OSError("transient I/O"))


def test_only_a_not_found_is_a_file_that_does_not_exist():
    """fsspec's HTTP filesystem reports a 403 as FileNotFoundError too: that shard exists, it is not said not to."""
    assert is_missing(FileNotFoundError("gone")) and is_missing(raised(FileNotFoundError("x"), ResponseError(404)))
    assert not is_missing(raised(FileNotFoundError("x"), ResponseError(403)))
    assert not is_missing(raised(FileNotFoundError("x"), ResponseError(503)))
    assert not is_missing(raised(FileNotFoundError("x"), ConnectionResetError("reset")))
    assert not is_missing(PermissionError("no")) and not is_missing(OSError("transient I/O"))


def test_credential_errors_are_permanent_and_not_retried():
    import pytest
    from botocore.exceptions import NoCredentialsError

    from datapipe.errors import DataError
    from datapipe.storage.files import retry_call

    assert is_permanent(NoCredentialsError())
    assert is_permanent(raised(OSError("wrapped"), NoCredentialsError()))
    calls = []

    def fails():
        calls.append(1)
        raise NoCredentialsError()

    with pytest.raises(DataError, match="credentials.*storage_options"):
        retry_call(fails, "s3://bucket/manifest.json", retries=5, backoff=10.0)
    assert len(calls) == 1


def test_connection_refused_reads_as_a_connection_error_not_a_missing_file(caplog):
    import socket

    import pytest

    from datapipe import DataError, ShardStream
    from datapipe.read.options import StorageOptions

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DataError) as info:
        ShardStream(f"http://127.0.0.1:{port}/shard-{{000..001}}.tar", 
                    storage=StorageOptions(retries=2, backoff=0.01)).counts
    assert "cannot connect" in str(info.value) and "FileNotFoundError" not in str(info.value)
    assert "in 0.01s" in caplog.text and "in 0.20s" not in caplog.text  # backoff= honoured by the manifest read


class _Clock:
    """Stands in for the ``time`` module inside datapipe.storage.files: time moves only when told."""

    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t

    def sleep(self, s):
        self.t += s


class _StallingFile:
    """A response from byte ``pos`` on that gives ``every`` bytes (each read taking ``read_s``), then stalls:
    the next read waits ``timeout`` and raises a timeout."""

    def __init__(self, data, pos, *, every, read_s, timeout, clock):
        self.data, self.pos, self.left = data, pos, every
        self.read_s, self.timeout, self.clock = read_s, timeout, clock
        self.size = len(data)

    def seek(self, pos):
        self.pos = pos

    def read(self, n):
        if self.pos < self.size and self.left == 0:
            self.clock.t += self.timeout
            raise TimeoutError("no byte within the timeout")
        n = min(n, self.left, self.size - self.pos)
        self.clock.t += self.read_s
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        self.left -= n
        return out

    def close(self):
        pass


def _stalling(monkeypatch, data, *, every, read_s, timeout=1.0, retries=2):
    """A RetryingFile over a fake store whose every response stalls after ``every`` bytes, on a fake clock."""
    from datapipe.storage import files

    clock = _Clock()

    class Store:
        def open(self, path, mode, **kwargs):
            return _StallingFile(data, 0, every=every, read_s=read_s, timeout=timeout, clock=clock)

    monkeypatch.setattr(files, "time", clock)
    monkeypatch.setattr(files, "filesystem", lambda url, options=None: (Store(), "/shard.tar"))
    options = {"config_kwargs": {"read_timeout": timeout}}  # as with_timeouts sets it: the file takes it from there
    return files.RetryingFile("s3://bucket/shard.tar", storage_options=options, retries=retries, backoff=0.0), clock


def _read_all(f):
    out = b""
    while True:
        chunk = f.read(4096)
        if not chunk:
            return out
        out += chunk


def test_a_store_that_stalls_after_every_16kb_gives_up_after_retries_plus_one_stalls(monkeypatch):
    import pytest

    from datapipe.errors import DataError

    data = bytes(range(256)) * 4096  # 1 MiB: 64 responses of 16 KiB
    f, clock = _stalling(monkeypatch, data, every=16384, read_s=0.0, timeout=1.0, retries=2)
    with pytest.raises(DataError, match="shard.tar") as info:
        _read_all(f)
    assert f.retried == 3 and f.pos == 3 * 16384, "progress earned no retry back: it took no time"
    assert clock.t == pytest.approx(3.0), "(retries + 1) x timeout"
    assert "lost 3.0 s" in str(info.value)


def test_reading_earns_a_retry_back_per_timeout_of_reading(monkeypatch):
    import pytest

    from datapipe.errors import DataError

    data = bytes(range(256)) * 4096
    # each response: 4 reads of 4 KiB taking 1.5 timeouts in all, then a stall of one timeout: it gains
    f, clock = _stalling(monkeypatch, data, every=16384, read_s=0.375, timeout=1.0, retries=2)
    assert _read_all(f) == data, "every byte once, in order"
    assert f.retried == 63
    # half a timeout of reading per stall: each stall costs half a retry, so 2 x (retries + 1) stalls end it
    f, clock = _stalling(monkeypatch, data, every=16384, read_s=0.125, timeout=1.0, retries=2)
    with pytest.raises(DataError, match="giving up at byte") as info:
        _read_all(f)
    assert f.retried == 6 and f.pos == 6 * 16384
    assert "stalled reading (no byte for 1.0 s)" in str(info.value)


def test_a_timeout_says_no_answer_not_cannot_connect():
    import aiohttp
    from fsspec.exceptions import FSTimeoutError

    from datapipe.storage.files import describe, read_timeout, with_timeouts

    text, _ = describe(raised(FSTimeoutError(), aiohttp.SocketTimeoutError("Timeout on reading data from socket")), [])
    assert text == "no answer within the timeout: SocketTimeoutError: Timeout on reading data from socket"
    text, _ = describe(raised(FSTimeoutError(), aiohttp.ConnectionTimeoutError("Connection timeout")), [])
    assert text == "cannot connect: ConnectionTimeoutError: Connection timeout"
    text, _ = describe(raised(OSError("x"), ConnectionRefusedError("refused")), [])
    assert text.startswith("cannot connect: ConnectionRefusedError")
    url = "http://127.0.0.1:1/shard.tar"
    assert read_timeout(url, with_timeouts(url, {}, 7.5)) == 7.5
    assert read_timeout("s3://b/shard.tar", with_timeouts("s3://b/shard.tar", {}, 3)) == 3.0
    assert read_timeout(url, {}) is None
