import os
import threading

import pytest

from datapipe.device import autotune

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")


def test_loader_cores_leave_the_lowest_cores_out(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 7, 1, 2, 5, 4, 6})
    assert autotune.loader_cores(2) == [2, 3, 4, 5, 6, 7]
    assert autotune.loader_cores(0) is None


def test_loader_cores_reserve_nothing_on_a_small_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)))
    assert autotune.loader_cores(2) is None  # 3 left: the loader would lose more than the step gains
    assert autotune.loader_cores(1) == [1, 2, 3, 4]


def _allowed(results: dict, key: str) -> None:
    results[key] = os.sched_getaffinity(0)


@needs_affinity
def test_confine_thread_holds_for_that_thread_and_the_threads_it_starts():
    before = os.sched_getaffinity(0)
    one = [min(before)]
    seen: dict = {}

    def producer():
        seen["confined"] = autotune.confine_thread(one)
        _allowed(seen, "producer")
        child = threading.Thread(target=_allowed, args=(seen, "child"))
        child.start()
        child.join()

    t = threading.Thread(target=producer)
    t.start()
    t.join()
    assert seen["confined"] is True
    assert seen["producer"] == seen["child"] == set(one)
    assert os.sched_getaffinity(0) == before  # the calling (training) thread keeps every core


def test_confine_thread_without_cores_does_nothing():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert autotune.confine_thread(None) is False
    assert autotune.confine_thread([]) is False
    if before is not None:
        assert os.sched_getaffinity(0) == before
