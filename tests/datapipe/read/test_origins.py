"""datapipe.read.origins: the values a worker read unchanged from a shard file, noted and taken back once."""
import os

import pytest

from datapipe.read import origins


@pytest.fixture(autouse=True)
def fresh():
    origins.enable(False)
    yield
    origins.enable(False)


def a_file(tmp_path, data=b"x" * 100_000):
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY), str(path)


def test_a_value_noted_is_taken_back_once_with_its_file_and_offset(tmp_path):
    fd, path = a_file(tmp_path)
    origins.enable()
    number = origins.file_of(fd)
    value = os.pread(fd, 20_000, 1_000)
    origins.note(value, number, 1_000)
    file, offset = origins.take(value)
    st = os.fstat(fd)
    assert file == (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) and offset == 1_000
    assert origins.take(value) is None  # taken once
    os.close(fd)


def test_an_equal_value_that_is_another_object_has_no_origin(tmp_path):
    fd, _ = a_file(tmp_path)
    origins.enable()
    value = os.pread(fd, 20_000, 0)
    origins.note(value, origins.file_of(fd), 0)
    assert origins.take(bytes(bytearray(value))) is None
    assert origins.take(value) is not None
    os.close(fd)


def test_nothing_is_noted_when_off_or_small():
    value = b"y" * 50_000
    origins.note(value, ("f", 0, 0, 0, 0), 0)  # off
    assert origins.take(value) is None
    origins.enable()
    small = b"z" * (origins.MIN_VALUE - 1)
    origins.note(small, ("f", 0, 0, 0, 0), 0)
    assert origins.take(small) is None


def noted(count: int, size: int) -> list[bytes]:
    """``count`` values of ``size`` bytes, noted (noting on) as read from one file at offsets 0, 1, ..."""
    origins.enable()
    values = [bytes([i]) * size for i in range(count)]
    for i, v in enumerate(values):
        origins.note(v, ("f", 0, 0, 0, 0), i)
    return values


def test_the_oldest_values_are_let_go_past_the_budget(monkeypatch):
    monkeypatch.setattr(origins, "BUDGET", 100_000)
    values = noted(5, 30_000)
    assert [origins.take(v) is not None for v in values] == [False, False, True, True, True]


def test_noting_switches_itself_off_when_nothing_is_taken(monkeypatch):
    monkeypatch.setattr(origins, "IDLE_NOTES", 10)
    values = noted(12, 20_000)
    assert not origins.enabled()
    assert all(origins.take(v) is None for v in values)  # and holds none


def test_a_deleted_file_has_no_number(tmp_path):
    fd, path = a_file(tmp_path)
    origins.enable()
    os.unlink(path)
    assert origins.file_of(fd) is None
    os.close(fd)
