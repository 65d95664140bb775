import threading

import pytest
import torch

from datapipe.device.handoff import Producer, close_last, started, threaded


def test_threaded_keeps_order_and_reraises():
    def gen():
        yield from range(5)
        raise ValueError("boom")

    got = []
    with pytest.raises(ValueError, match="boom"):
        for x in threaded(gen(), depth=2):
            got.append(x)
    assert got == list(range(5))


def test_threaded_runs_ahead_at_most_depth_items():
    made = []

    def gen():
        for i in range(100):
            made.append(i)
            yield i

    it = threaded(gen(), depth=3)
    assert next(it) == 0
    deadline = threading.Event()
    deadline.wait(0.3)
    assert len(made) <= 1 + 3 + 1  # handed out + queued + the one waiting to be put
    it.close()


def test_closing_stops_the_thread_and_closes_the_producer_in_its_thread():
    where = {}

    def gen():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            where["closed_in"] = threading.current_thread().name

    before = threading.active_count()
    it = threaded(gen(), depth=2, name="producer-under-test")
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert where["closed_in"] == "producer-under-test"
    assert threading.active_count() == before


def test_close_last_closes_a_live_iterator_and_ignores_a_gone_one():
    import weakref

    closed = []

    def gen():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    g = gen()
    next(g)
    ref = weakref.ref(g)
    close_last(ref)
    assert closed == [True] and next(g, None) is None
    del g
    close_last(ref)  # collected: nothing to do
    close_last(None)


def test_started_fetches_the_first_item_now():
    made = []

    def gen():
        for i in range(3):
            made.append(i)
            yield i

    s = started(gen())
    assert made == [0]
    assert list(s) == [0, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_current_stream_follows_the_threads_stream_and_reuses_its_object():
    from datapipe.device.handoff import CurrentStream

    device = torch.device("cuda")
    current = CurrentStream(device)
    first = current()
    assert first == torch.cuda.current_stream(device)
    assert current() is first  # the same stream: the same object, no new Stream built
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        assert current() == side
    assert current() == first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_retirer_records_passed_events_again_instead_of_making_new_ones():
    from datapipe.device.handoff import Retirer

    r = Retirer(torch.device("cuda"), keep=2)
    events = {}  # id -> event, held so no id is reused
    for i in range(20):
        r.handed(torch.full((4,), i, device="cuda"))
        events.update({id(marker): marker for _, marker in r._dead})
        torch.cuda.synchronize()
        r.bury()
    assert not r._dead  # every fence passed after the synchronize: all retired batches freed
    assert len(events) <= 3  # 18 batches retired through a few events


def test_the_producer_waits_for_the_handoff_before_making_more():
    made, handed = [], []

    def gen():
        for i in range(6):
            made.append(i)
            yield i

    def handoff(item):
        handed.append(item)
        threading.Event().wait(0.05)
        assert len(made) <= len(handed) + 1  # depth 1: at most the next item is made before a handoff ends

    assert list(threaded(gen(), depth=1, handoff=handoff)) == list(range(6))
    assert handed == list(range(6))


def test_paced_producer_times_the_consumer_and_delivers_everything(monkeypatch):
    from datapipe.device.handoff import Producer

    monkeypatch.delenv("DATAPIPE_PACE", raising=False)
    producer = Producer(iter(range(20)), depth=2, pace=0.5)
    assert list(producer) == list(range(20))
    assert producer._pacer is not None and producer._pacer.period is not None
    assert Producer(iter(()), depth=2)._pacer is None  # off unless asked for


def test_producer_meter_counts_the_threads_cpu_time_per_item():
    import time

    from datapipe.device.handoff import Producer, ProducerMeter

    def busy_items(n):
        for i in range(n):
            end = time.thread_time() + 0.005  # 5 ms of this thread's CPU per item
            while time.thread_time() < end:
                pass
            yield i

    meter = ProducerMeter()
    assert list(Producer(busy_items(6), depth=2, meter=meter)) == list(range(6))
    assert meter.items == 6 and meter.cpu_s >= 0.025
    assert list(Producer(busy_items(2), depth=2, meter=meter)) == [0, 1]  # a kept meter adds up epochs
    stats = meter.stats()
    assert stats["batches"] == 8 and stats["cpu_ms_per_batch"] >= 4.0


def test_producer_meter_counts_takes_that_found_nothing_and_items_made_unpaced(monkeypatch):
    import time

    from datapipe.device.handoff import Producer, ProducerMeter

    monkeypatch.delenv("DATAPIPE_PACE", raising=False)

    def slow(n):
        for i in range(n):
            time.sleep(0.02)  # slower than the consumer: it finds the queue empty
            yield i

    meter = ProducerMeter()
    assert list(Producer(slow(6), depth=2, meter=meter, pace=0.5)) == list(range(6))
    stats = meter.stats()
    assert stats["empty_takes"] >= 3 and stats["unpaced"] >= 1  # an empty take turns holding off
    fast = ProducerMeter()
    producer = Producer(iter(range(6)), depth=2, meter=fast)
    deadline = time.monotonic() + 10
    while fast.items < 2 and time.monotonic() < deadline:  # item 1 is made after item 0 is queued
        time.sleep(0.01)
    assert next(producer) == 0 and fast.empty_takes == 0 and fast.unpaced == 0  # unpaced producer: never held
    producer.close()


class _Marker:
    def __init__(self):
        self.passed = False

    def query(self):
        return self.passed


class _Batch:
    pass


def _fenced_retirer(**options):
    """A CPU Retirer whose fences are markers the test passes by hand: (retirer, markers made so far)."""
    from datapipe.device.handoff import Retirer

    markers = []

    def fence():
        markers.append(_Marker())
        return markers[-1]

    return Retirer(torch.device("cpu"), fence=fence, **options), markers


def _hand(retirer, n: int) -> list:
    """Hand ``n`` new batches to ``retirer`` and keep no reference: weak references to them."""
    import weakref

    alive = []
    for _ in range(n):
        b = _Batch()
        alive.append(weakref.ref(b))
        retirer.handed(b)
        del b
    return alive


def test_retirer_keeps_the_last_items_and_frees_older_ones_once_their_fence_passed():
    r, markers = _fenced_retirer(keep=2)
    alive = _hand(r, 4)
    assert len(markers) == 2  # batches 0 and 1 retired, 2 and 3 kept
    r.bury()
    assert all(ref() is not None for ref in alive)  # fences not passed: nothing freed yet
    markers[0].passed = True
    r.bury()
    assert alive[0]() is None and alive[1]() is not None  # freed in order, only once passed
    markers[1].passed = True
    r.bury()
    assert alive[1]() is None and alive[2]() is not None and alive[3]() is not None
    r.clear()
    assert all(ref() is None for ref in alive)


def test_producer_frees_retired_items_in_its_own_thread():
    import weakref

    from datapipe.device.handoff import Producer, Retirer

    freed_in = []

    class Batch:
        def __del__(self):
            freed_in.append(threading.current_thread().name)

    passed = _Marker()
    passed.passed = True
    producer = Producer((Batch() for _ in range(8)), depth=1, name="producer-under-test",
                        retire=Retirer(torch.device("cpu"), keep=2, fence=lambda: passed))
    refs = [weakref.ref(b) for b in producer]
    assert len(refs) == 8
    producer.close()
    assert freed_in[:5] == ["producer-under-test"] * 5  # the first items: freed by the producer
    assert all(r() is None for r in refs)


def test_a_retirer_and_its_items_go_with_their_last_reference_not_the_cyclic_collector():
    """A cycle would free device batches whenever gc runs, also in a forked worker (where CUDA aborts)."""
    import gc
    import weakref

    from datapipe.device.handoff import Retirer

    class Batch:
        pass

    gc.disable()
    try:
        r = Retirer(torch.device("cpu"), keep=1, fence=lambda: _Marker())
        b = Batch()
        items = weakref.ref(b)
        r.handed(b)
        r.handed(Batch())
        del b
        ref = weakref.ref(r)
        del r
        assert ref() is None and items() is None
        r = Retirer(torch.device("cuda"))  # the default fence is not stored as a bound method
        ref = weakref.ref(r)
        del r
        assert ref() is None
    finally:
        gc.enable()


def test_a_stopper_waits_for_the_thread_of_a_producer_already_dropped():
    """Dropping a producer only asks its thread to stop; its stopper waits until the thread is done with the
    iterable (a loader's next pass must not share it with the last one's thread)."""
    import gc
    import time

    inside, ended = threading.Event(), threading.Event()

    def slow():
        for i in range(100):
            inside.set()
            time.sleep(0.05)  # the thread is here, mid-item, when its producer goes
            yield i
        ended.set()

    def made():
        producer = Producer(slow(), depth=2)
        next(producer)
        return producer.stopper()

    stop = made()
    gc.collect()
    assert inside.wait(5)
    assert stop() is True  # the thread has ended
    assert not ended.is_set()  # stopped early, not run to its end


def test_pass_threads_wait_for_a_dropped_pass_however_long_and_say_so(monkeypatch, caplog):
    """A dropped pass inside a long dataset call is waited for (torch's next pass would wait too), with a note
    every WAIT_NOTE_S seconds; a pass still referenced is left running."""
    import logging
    import time

    from datapipe.device import handoff

    monkeypatch.setattr(handoff, "WAIT_NOTE_S", 0.1)

    def slow():
        time.sleep(0.35)  # one long item: the thread sees the stop only after it
        yield 1

    class Pass:
        pass

    threads = handoff.PassThreads()
    kept, dropped = Pass(), Pass()
    a, b = Producer(iter([1, 2]), depth=1), Producer(slow(), depth=1)
    threads.add(kept, a.stopper())
    threads.add(dropped, b.stopper())
    del dropped
    with caplog.at_level(logging.WARNING, logger=handoff.__name__):
        threads.wait()
    assert not b._thread.is_alive() and "waiting for a pass left unfinished" in caplog.text
    assert len(threads._passes) == 1 and next(a) == 1  # the live one runs on
    a.close()
