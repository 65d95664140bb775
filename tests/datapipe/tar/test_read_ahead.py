"""ReadAhead: a shard's values read ahead by pool threads through its member table equal the walk's, and a
shard that shrinks, small values and a reader that stops early are handled."""
import os

import pytest

from datapipe import DataError, ShardStream, StorageOptions
from datapipe.read import pools, spans
from datapipe.tar import read_ahead
from tests.datapipe.tar.test_member_table import _cut_after_the_table_is_read, _read, _samples, _write


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_values_read_ahead_in_threads_are_the_walks(tmp_path, monkeypatch, threads):
    """``StorageOptions(read_threads=)``: the values of the next samples read ahead together (``start_spans``)
    in that many pool threads; small chunks so that a shard takes many."""
    monkeypatch.setattr(read_ahead.ReadAhead, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(read_ahead.ReadAhead, "MIN_SAMPLE_BYTES", 0)  # these values are small
    monkeypatch.setattr(spans, "MIN_THREAD_BYTES", 4096)
    _write(str(tmp_path), _samples(300), max_count=100)
    chunks = []
    real = spans.start_spans
    monkeypatch.setattr(spans, "start_spans", lambda fd, s, **k: chunks.append(len(s)) or real(fd, s, **k))
    read = _read(str(tmp_path), False, monkeypatch, shuffle=True, seed=3, shuffle_buffer=50,
                 storage=StorageOptions(read_threads=threads))
    assert read == _read(str(tmp_path), True, monkeypatch, shuffle=True, seed=3, shuffle_buffer=50)
    assert (len(chunks) >= 6) == (threads > 0), chunks
    if threads > 1:
        assert pools.current(spans.POOL)._max_workers >= threads


def test_small_values_are_read_a_pread_each(tmp_path, monkeypatch):
    """Under MIN_SAMPLE_BYTES a sample, a chunk turns the read-ahead off for the rest of the shard."""
    _write(str(tmp_path), [{"__key__": f"k{i:04d}", "bin": b"x" * 1000, "cls": b"1"} for i in range(500)])
    started = []
    real = spans.start_spans
    monkeypatch.setattr(spans, "start_spans", lambda *a, **k: started.append(1) or real(*a, **k))
    assert len(list(ShardStream(str(tmp_path), storage=StorageOptions(read_threads=2)))) == 500
    assert not started
    monkeypatch.setattr(read_ahead.ReadAhead, "MIN_SAMPLE_BYTES", 100)
    assert len(list(ShardStream(str(tmp_path), storage=StorageOptions(read_threads=2)))) == 500
    assert started


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_reader_that_stops_early_does_not_wait_and_leaves_no_descriptor(tmp_path, monkeypatch):
    """A read in flight goes on on its own duplicate of the file descriptor (the shard's file closes at once,
    nothing waits: a collector running on a pool thread could not), and the duplicate closes when it ends."""
    import threading
    import time

    monkeypatch.setattr(read_ahead.ReadAhead, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(read_ahead.ReadAhead, "MIN_SAMPLE_BYTES", 0)
    _write(str(tmp_path), _samples(300))
    release = threading.Event()
    real_share = spans._read_share
    calls = []
    monkeypatch.setattr(spans, "_read_share", lambda *a: (calls.append(1) or len(calls) < 2 or release.wait(5))
                        and real_share(*a))
    before = _open_fds()
    it = iter(ShardStream(str(tmp_path), storage=StorageOptions(read_threads=1)))
    next(it)
    started = time.perf_counter()
    it.close()
    assert time.perf_counter() - started < 1  # the blocked read was not waited for
    release.set()
    deadline = time.time() + 5
    while _open_fds() > before and time.time() < deadline:
        time.sleep(0.01)
    assert _open_fds() == before


def test_a_shard_that_shrank_under_the_read_ahead_hands_out_what_it_holds(tmp_path, monkeypatch):
    """The chunk that crosses the cut is read value by value: the samples before it come, then the error."""
    monkeypatch.setattr(read_ahead.ReadAhead, "MIN_SAMPLE_BYTES", 0)  # read ahead these small values too
    (path,) = _write(str(tmp_path), _samples(40))
    _cut_after_the_table_is_read(monkeypatch, path, 30_000)
    got = {}
    for threads in (0, 2):
        stream = ShardStream(str(tmp_path), storage=StorageOptions(read_threads=threads))
        got[threads] = []
        with pytest.raises(DataError, match="ends inside member"):
            for sample in stream:
                got[threads].append(sample["__key__"])
        os.truncate(path, 0)
        _write(str(tmp_path), _samples(40))
    assert got[0] == got[2] and 0 < len(got[0]) < 40
