"""IdleWatch: the part of a consumer's wait during which its stream had nothing left to run."""
import threading

import pytest

from datapipe.device.idle_watch import IdleWatch


class Stream:
    """A stream whose ``query()`` says whether it has run dry; counts the questions."""

    def __init__(self, idle=False):
        self.idle = idle
        self.asked = 0

    def query(self):
        self.asked += 1
        return self.idle


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(stream, threaded=False):
    clock = Clock()
    return IdleWatch(lambda: stream, clock=clock, threaded=threaded), clock


def test_a_wait_that_begins_with_the_stream_dry_counts_whole():
    s = Stream(idle=True)
    w, clock = make(s)
    clock.now = 1.0
    w.begin()
    clock.now = 1.25
    assert w.end() == 0.25


def test_a_wait_while_the_stream_still_runs_queued_steps_counts_nothing():
    """The host waiting for its GPU (a loop that runs ahead, CUDA graphs) does not starve it."""
    s = Stream(idle=False)
    w, clock = make(s)
    w.begin()
    for t in (0.01, 0.02, 0.03):
        clock.now = t
        w.poll()
    clock.now = 0.04
    assert w.end() == 0.0


def test_only_the_time_after_the_stream_ran_dry_counts():
    s = Stream(idle=False)
    w, clock = make(s)
    w.begin()
    clock.now = 0.030
    w.poll()  # still busy
    s.idle = True
    clock.now = 0.031
    w.poll()  # ran dry: the starved part starts here
    clock.now = 0.032
    w.poll()  # a later look does not move it
    clock.now = 0.035
    assert abs(w.end() - 0.004) < 1e-12


def test_a_finding_of_an_earlier_wait_does_not_count_in_the_next():
    s = Stream(idle=True)
    w, clock = make(s)
    w.begin()
    clock.now = 0.01
    assert w.end() == 0.01
    s.idle = False
    w.begin()  # busy now: the last wait's idle start is not this one's
    clock.now = 0.05
    assert w.end() == 0.0


def test_the_helper_thread_finds_the_dry_stream_while_the_consumer_waits():
    found = threading.Event()

    class Dry(Stream):
        def query(self):
            answer = super().query()
            if answer:
                found.set()
            return answer

    s = Dry(idle=False)
    w, clock = make(s, threaded=True)
    try:
        clock.now = 1.0
        w.begin()
        s.idle = True
        assert found.wait(timeout=10)  # the thread looked (bounded: never a hang)
        for _ in range(1000):  # its finding is stored right after it looked
            if w._since is not None:
                break
            threading.Event().wait(0.001)
        clock.now = 2.0
        assert w.end() == 1.0
        assert w._thread is not None and w._thread.daemon
    finally:
        w.close()
    w._thread.join(timeout=10)
    assert not w._thread.is_alive()


def test_no_thread_starts_while_every_wait_begins_dry():
    s = Stream(idle=True)
    w, _ = make(s, threaded=True)
    for _ in range(3):
        w.begin()
        w.end()
    assert w._thread is None
    w.close()


@pytest.mark.gpu
def test_gpu_a_wait_behind_queued_work_starves_only_from_when_the_stream_ran_dry():
    import time

    import torch

    stream = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000)  # warm the sleep kernel up
    stream.synchronize()
    w = IdleWatch(lambda: stream)
    try:
        torch.cuda._sleep(100_000_000)  # tens of ms of queued work: the host waits behind it
        t0 = time.perf_counter()
        w.begin()
        stream.synchronize()
        busy = time.perf_counter() - t0
        threading.Event().wait(0.05)  # then the stream has nothing to run while the wait goes on
        starved = w.end()
        wait = time.perf_counter() - t0
    finally:
        w.close()
    assert 0.0 < starved < wait - busy / 2  # the part after the queued work, not the whole wait
