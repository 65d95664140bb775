from datapipe.storage import is_permanent


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
