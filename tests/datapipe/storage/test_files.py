from datapipe.storage.files import is_permanent


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
