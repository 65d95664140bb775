"""loaders.dataloader.deaths: a worker that dies is torch's error, from any thread that reads torch's pipe, with any
``device`` and source; nothing wrong before it, and no worker left once the loader is closed or dropped."""
import functools
import gc
import os
import signal
import weakref

import numpy as np
import pytest
import torch
import webdataset
from torch.utils.data import Dataset

from datapipe import ShardStream
from loaders import DataLoader
from loaders.dataloader import deaths
from tests.loaders.dataloader.test_loader import _fake_pinning

TORCH_MESSAGE = r"DataLoader worker \(pid"


# ---------------------------------------------------------------- the parts ------------------------

class FakeIterator:
    """torch's multi-process iterator as deaths sees it: ``_try_get_data``, ``_workers``, ``_workers_status``."""

    def __init__(self, workers):
        self._workers = workers
        self._workers_status = [True] * len(workers)
        self.asked = []

    def _try_get_data(self, timeout=5.0):
        self.asked.append(timeout)
        return False, None


class Worker:
    def __init__(self, pid, alive_checks=None):
        self.pid = pid
        self.checks = alive_checks  # None: alive for good; n: alive for n more checks

    def is_alive(self):
        if self.checks is None:
            return True
        self.checks -= 1
        return self.checks >= 0


def test_a_waiting_iterator_looks_at_its_workers_often_and_keeps_a_users_timeout():
    it = FakeIterator([Worker(1)])
    deaths.watch(it)
    deaths.watch(it)  # once
    it._try_get_data()
    it._try_get_data(7.0)
    assert it.asked == [deaths.POLL_S, 7.0] and deaths.POLL_S < 1.0


def test_a_watched_iterator_is_freed_when_dropped_without_the_collector():
    """torch's iterator shuts its workers down when freed: a cycle through it would leave that to the cyclic
    collector, whose order of finalizers closes its queues first (a dropped loader's workers then lingered)."""
    it = FakeIterator([Worker(1)])
    deaths.watch(it)
    ref = weakref.ref(it)
    gc.disable()
    try:
        del it
        assert ref() is None
    finally:
        gc.enable()


def test_a_broken_connection_waits_for_its_worker_to_count_as_dead():
    it = FakeIterator([Worker(11), Worker(12, alive_checks=3)])
    err = deaths.death(it, ConnectionResetError(104, "reset"))
    assert isinstance(err, RuntimeError) and "(pid(s) 12) exited unexpectedly" in str(err) and deaths.fatal(err)
    it = FakeIterator([Worker(11), Worker(12, alive_checks=1)])
    assert deaths.death(it, ValueError("a bad sample")) is None  # not a connection: no wait (alive at the look)
    it = FakeIterator([Worker(11), Worker(12, alive_checks=0)])
    it._workers_status[1] = False  # exhausted and let go by torch (an iterable dataset's): not a death
    assert deaths.death(it, EOFError()) is None
    assert not deaths.fatal(RuntimeError("Caught ValueError in DataLoader worker process 0."))


# ---------------------------------------------------------------- whole loaders --------------------

class Stamped(Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        return {"key": f"k{i:06d}".encode() * 100, "t": torch.full((200,), i)}


def samples(batch):
    return list(batch)


def _note_pid(directory, worker_id):
    with open(os.path.join(directory, f"pid-{os.getpid()}"), "w"):
        pass


def _pids(directory):
    return sorted(int(name[4:]) for name in os.listdir(directory) if name.startswith("pid-"))


def _gone(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def _run_until_a_worker_dies(dl, tmp_path, check):
    """Take 3 batches, kill one worker, go on: returns (the error, the iterator, the next batch's number)."""
    it = iter(dl)
    n = 0
    for _ in range(3):
        check(next(it), n)
        n += 1
    victim = _pids(tmp_path)[0]
    # never ConnectionResetError, EOFError. torch's signal handler raises in the main thread wherever it is:
    # the kill comes inside the block
    with pytest.raises(RuntimeError, match=TORCH_MESSAGE) as info:
        os.kill(victim, signal.SIGKILL)
        while True:
            batch = next(it)
            n += 1  # counted before the check: the signal may interrupt the check, not the batch
            check(batch, n - 1)  # nothing wrong before the error
    return info.value, it, n


def _the_pass_ends(it, n, check):
    """After the error the pass ends (torch's iterator would go on without the dead worker's batches). torch's
    signal handler may raise its error in the main thread anywhere, in the test's own code too: then the pass
    ends at the loader's next look, a batch already received may come first, exact."""
    for _ in range(20):
        try:
            batch = next(it)
            n += 1
            check(batch, n - 1)
        except StopIteration:
            return
        except RuntimeError as e:
            assert deaths.fatal(e)
    raise AssertionError("the pass went on after a worker died")


def _check_stamped(batch, n):
    assert [s["key"] for s in batch] == [f"k{i:06d}".encode() * 100 for i in range(n * 8, n * 8 + 8)]
    assert all(bool((s["t"] == i).all()) for i, s in enumerate(batch, n * 8))


def _signal(monkeypatch, on: bool):
    """torch's SIGCHLD handler raises its error in the main thread, wherever it is; off: the loader must find
    the dead worker itself, in whichever thread reads torch's pipe (its prefetch or pin thread)."""
    if not on:
        from torch.utils.data._utils import signal_handling

        monkeypatch.setattr(signal_handling, "_error_if_any_worker_fails", lambda: None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("where", [None, "cpu", "pin"])
@pytest.mark.parametrize("signal_on", [True, False])
def test_a_killed_worker_is_torchs_error_and_no_worker_outlives_the_loader(monkeypatch, tmp_path, where, persistent,
                                                                           signal_on):
    _signal(monkeypatch, signal_on)
    ending = "drop" if signal_on else "close"
    kw = dict(persistent_workers=persistent)
    if where == "pin":
        _fake_pinning(monkeypatch)
        kw["pin_memory"] = True
    elif where == "cpu":
        kw["device"] = "cpu"
    dl = DataLoader(Stamped(), batch_size=8, num_workers=2, collate_fn=samples,
                    worker_init_fn=functools.partial(_note_pid, str(tmp_path)), **kw)
    err, it, n = _run_until_a_worker_dies(dl, tmp_path, _check_stamped)
    _the_pass_ends(it, n, _check_stamped)
    pids = _pids(tmp_path)
    if persistent:  # the dead worker's set was let go: the next pass starts new workers and is whole
        again = iter(dl)
        for k in range(4):
            _check_stamped(next(again), k)
        again.close()
        del again
        pids = _pids(tmp_path)
    if ending == "close":
        dl.close()
    else:
        del dl, it, err
        gc.collect()
    assert [p for p in pids if not _gone(p)] == []


def _raw_shards(directory, shards=4, per_shard=24):
    os.makedirs(directory, exist_ok=True)
    urls = []
    for s in range(shards):
        path = os.path.join(directory, f"shard-{s:06d}.tar")
        with webdataset.TarWriter(path) as w:
            for j in range(per_shard):
                i = s * per_shard + j
                w.write({"__key__": f"{i:06d}", "jpg": np.full(40_000, i % 251, np.uint8).tobytes(),
                         "cls": str(i).encode()})
        urls.append(path)
    return urls


def _check_raw(batch, n):
    for s in batch:  # raw samples: bytes copied out of the workers' shared memory
        i = int(s["cls"])
        assert s["__key__"] == f"{i:06d}" and s["jpg"] == bytes([i % 251]) * 40_000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", [None, "cpu"])
@pytest.mark.parametrize("signal_on", [True, False])
def test_a_killed_worker_under_a_shardstream_of_raw_samples_is_torchs_error(monkeypatch, tmp_path, where, signal_on):
    _signal(monkeypatch, signal_on)
    urls = _raw_shards(tmp_path / "data", shards=8, per_shard=40)
    pids = tmp_path / "pids"
    pids.mkdir()
    dl = DataLoader(ShardStream(urls), batch_size=8, num_workers=2, collate_fn=samples, device=where,
                    worker_init_fn=functools.partial(_note_pid, str(pids)))
    _, it, n = _run_until_a_worker_dies(dl, pids, _check_raw)
    _the_pass_ends(it, n, _check_raw)
    assert dl.stats()["raw_shared_memory"]["batches"] >= 3  # the raw samples did travel in shared memory
    dl.close()
    assert [p for p in _pids(pids) if not _gone(p)] == []
