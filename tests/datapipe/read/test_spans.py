"""start_spans: many values of a file read ahead into fresh bytes with preadv in pool threads; equal to a pread each,
or None."""
import os
import random

import numpy as np
import pytest

from datapipe.read import spans
from datapipe.read.spans import read_threads, start_spans

pytestmark = pytest.mark.skipif(not spans.available(), reason="needs preadv in the C library (Linux)")


def read_spans(fd, wanted, threads=1):
    reading = start_spans(fd, wanted, threads=threads)
    return None if reading is None else reading.result()


@pytest.fixture()
def blob_fd(tmp_path):
    data = random.Random(0).randbytes(3 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data, path
    os.close(fd)


def _tar_like(size: int, seed: int = 1) -> list[tuple[int, int]]:
    """Values with small gaps between them (headers, padding), a few empty ones, one far jump."""
    rnd = random.Random(seed)
    out, at = [], 0
    while True:
        at += rnd.choice((0, 512, 1024, 700))
        n = rnd.choice((0, 1, 3, rnd.randrange(10, 40000)))
        if at + n > size:
            return out
        out.append((at, n))
        at += n
        if rnd.random() < 0.02:
            at += 200_000  # wider than MAX_GAP: a stretch ends


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_values_are_what_pread_gives(blob_fd, monkeypatch, threads):
    fd, data, _ = blob_fd
    monkeypatch.setattr(spans, "MIN_THREAD_BYTES", 1 << 16)  # so that a few MB use every thread
    wanted = _tar_like(len(data))
    got = read_spans(fd, wanted, threads=threads)
    assert got == [data[o:o + n] for o, n in wanted]
    assert all(type(v) is bytes for v in got)


def test_spans_out_of_order_and_overlapping(blob_fd):
    fd, data, _ = blob_fd
    wanted = [(5000, 100), (10, 20), (15, 30), (2_000_000, 5), (0, 0)]
    assert read_spans(fd, wanted) == [data[o:o + n] for o, n in wanted]


def test_a_stretch_holds_at_most_iov_max_buffers(blob_fd, monkeypatch):
    fd, data, _ = blob_fd
    monkeypatch.setattr(spans, "MAX_IOV", 4)
    calls = []
    real = spans._read_stretch
    monkeypatch.setattr(spans, "_read_stretch", lambda *a: calls.append(a[3]) or real(*a))
    wanted = [(i * 600, 100) for i in range(30)]
    assert read_spans(fd, wanted) == [data[o:o + n] for o, n in wanted]
    assert all(count <= 4 for count in calls) and len(calls) >= 15


def test_values_past_the_end_give_none(blob_fd):
    fd, data, _ = blob_fd
    assert read_spans(fd, [(0, 10), (len(data) - 5, 10)]) is None
    assert read_spans(fd, [(len(data) + 100, 10)]) is None


def test_values_over_the_largest_read_give_none(blob_fd, monkeypatch):
    fd, _, _ = blob_fd
    monkeypatch.setattr(spans, "MAX_VALUE", 1000)
    assert read_spans(fd, [(0, 10), (100, 1001)]) is None


def test_a_preadv_cut_short_is_finished_value_by_value(blob_fd):
    fd, data, _ = blob_fd
    _, new_bytes, offset, scratch, _ = spans._functions()
    wanted = [(0, 5000), (5512, 3000), (9000, 4000)]
    real_preadv = spans._functions()[0]

    def short(fd_, iov, count, at):  # a signal after the first 6,000 bytes
        return min(real_preadv(fd_, iov, count, at), 6000)

    values = [new_bytes(None, n) for _, n in wanted]
    iov = np.array([id(values[0]) + offset, 5000, scratch, 512, id(values[1]) + offset, 3000,
                    scratch, 488, id(values[2]) + offset, 4000], np.uint64)
    assert spans._read_stretch(short, fd, iov, 5, 0, 13000)
    assert values == [data[o:o + n] for o, n in wanted]


def test_read_threads_follow_the_setting_and_the_cores(monkeypatch):
    from datapipe.device import autotune

    assert read_threads(0, in_worker=False) == 0
    assert read_threads(3, in_worker=True) == 3  # asked for: as asked
    assert read_threads(None, in_worker=True) == 0  # the workers are the parallelism
    for cores, threads in ((1, 0), (2, 2), (8, 2), (12, 3), (16, 4), (128, spans.MAX_THREADS)):
        monkeypatch.setattr(autotune, "usable_cores", lambda: cores)
        assert read_threads(None, in_worker=False) == threads, cores


def test_a_sandbox_that_refuses_preadv_turns_the_read_ahead_off(blob_fd, monkeypatch):
    import ctypes
    import errno

    fd, data, _ = blob_fd
    lib = spans._functions()
    monkeypatch.setattr(spans, "_lib", lib)

    def refused(*args):
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(spans, "_lib", (refused, *lib[1:]))
    assert read_spans(fd, [(0, 10)]) is None
    assert start_spans(fd, [(0, 10)]) is None  # refused before any value is made
    assert not spans.available() and read_threads(None, in_worker=False) == 0


def test_the_caller_goes_on_while_the_threads_read(blob_fd, monkeypatch):
    import threading

    fd, data, _ = blob_fd
    release = threading.Event()
    real = spans._read_share
    monkeypatch.setattr(spans, "_read_share", lambda *a: release.wait(5) and real(*a))
    reading = start_spans(fd, [(0, 1000), (3000, 5)], threads=2)
    assert not reading.futures[0].done()  # started, not finished: start_spans did not wait
    release.set()
    assert reading.result() == [data[:1000], data[3000:3005]]


def test_a_thread_that_fails_is_raised_after_every_thread_is_done(blob_fd, monkeypatch):
    fd, _, _ = blob_fd
    monkeypatch.setattr(spans, "MIN_THREAD_BYTES", 1000)
    calls = []

    def failing(preadv, fd_, share, values):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("boom")
        return True

    monkeypatch.setattr(spans, "_read_share", failing)
    reading = start_spans(fd, [(0, 5000), (200_000, 5000)], threads=2)
    with pytest.raises(OSError, match="boom"):
        reading.result()
    assert len(calls) == 2 and all(f.done() for f in reading.futures)


def test_a_read_after_the_interpreter_began_to_shut_down_is_left_to_the_caller(blob_fd, monkeypatch):
    fd, _, _ = blob_fd

    class Closed:
        def submit(self, *args):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(spans, "_executor", lambda threads: Closed())
    before = len(os.listdir("/proc/self/fd"))
    assert start_spans(fd, [(0, 10)]) is None
    assert len(os.listdir("/proc/self/fd")) == before  # the duplicate descriptor is closed


def test_a_forked_child_reads_for_itself(blob_fd):
    """A read started before a fork has no threads in the child: its result there is None (the caller reads the
    values itself), never a wait that cannot end."""
    fd, _, _ = blob_fd
    reading = start_spans(fd, [(0, 10), (100, 10)])
    pid = os.fork()
    if pid == 0:
        os._exit(0 if reading.result() is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reading.result() is not None


def test_the_threads_read_a_descriptor_of_their_own(blob_fd, monkeypatch):
    """The caller may close its descriptor while the threads read."""
    import threading

    fd, data, path = blob_fd
    release = threading.Event()
    real = spans._read_share
    monkeypatch.setattr(spans, "_read_share", lambda *a: release.wait(5) and real(*a))
    mine = os.open(path, os.O_RDONLY)
    reading = start_spans(mine, [(0, 1000), (2000, 10)])
    os.close(mine)
    release.set()
    assert reading.result() == [data[:1000], data[2000:2010]]
