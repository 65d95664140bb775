"""loaders.dataloader.unpacking with ``AHEAD = 2``: the pass's thread holds two batches started beyond the one it
starts next, so up to three batches' reads of the workers' memory are in flight at once (``AHEAD = 1``: two). A
worker keeps a batch's leaves alive until the main process sets the batch's segment ``FREE`` (after its copies:
RawCopies.finish / release), whatever prefetch_factor, so a deeper read-ahead must stay exact; a worker whose pool
(prefetch_factor + 2 segments) has none free sends the batch through torch's pipe instead, which must be exact too.
The scenarios of test_unpacking.py and test_vmread_patterns.py (reused, not copied) run here at that depth, on any
machine, the way those files force the 12-core behaviour."""
import time

import pytest

from loaders import DataLoader
from loaders.dataloader import handback, rawshm, unpacking, vmread
from loaders.dataloader.shm import recycling_available
from tests.loaders.dataloader import test_unpacking as tu
from tests.loaders.dataloader import test_vmread_patterns as tv

pytestmark = [pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing"),
              pytest.mark.skipif(not vmread.allowed(*vmread.writer()), reason="this machine refuses process_vm_readv")]

DEPTH = 2


class Seen:
    """What the main process did: the depth of each read-ahead thread made, the batches started by kind (``r``: read
    out of a worker's memory; ``copied``: out of its segment; ``plain``: torch's pipe), the most started at once."""

    def __init__(self):
        self.depths, self.kinds, self.most = [], {"r": 0, "copied": 0, "plain": 0}, 0


@pytest.fixture(autouse=True)
def deeper(monkeypatch):
    """As test_unpacking.as_on_many_cores (and test_vmread_patterns' ``ahead``), with AHEAD = 2."""
    monkeypatch.setattr(vmread, "MIN_CORES", 0)
    monkeypatch.setattr(handback, "HOLD", False)
    monkeypatch.setattr(rawshm, "read_threads", lambda: 4)
    monkeypatch.setattr(unpacking, "AHEAD", DEPTH)
    seen = Seen()
    real_threaded, real_start = unpacking.threaded, rawshm.RawCopies.start

    def threaded(items, *, depth, **kw):
        seen.depths.append(depth)
        return real_threaded(items, depth=depth, **kw)

    def start(self, batch):
        packed = type(batch) is rawshm.Packed
        seen.kinds["r" if packed and batch[3][:1] == "r" else "copied" if packed else "plain"] += 1
        out = real_start(self, batch)
        seen.most = max(seen.most, len(self.inflight))
        return out

    monkeypatch.setattr(unpacking, "threaded", threaded)
    monkeypatch.setattr(rawshm.RawCopies, "start", start)
    return seen


def read_ahead_at_depth(seen: Seen, reads: bool = True) -> list[str]:
    """What the scenario missed (nothing: ``[]``) of the read-ahead path at AHEAD = 2: the thread made at that depth,
    (``reads``) reads out of the workers' memory, at most DEPTH + 1 batches started at once (the thread's queue and
    the batch the consumer finishes)."""
    problems = []
    if not seen.depths or set(seen.depths) != {DEPTH}:
        problems.append(f"read-ahead threads of depths {seen.depths}")
    if reads and seen.kinds["r"] == 0:
        problems.append(f"no batch read out of a worker's memory: {seen.kinds}")
    if seen.most > DEPTH + 1:
        problems.append(f"{seen.most} batches started at once")
    return problems


# ---- test_unpacking.py's scenarios ---------------------------------------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("at", [0, 3, 7, "end"])  # 8 batches: 7 is the last one
def test_break_at_first_middle_last_then_whole_passes(deeper, persistent, at):
    tu.test_break_at_every_point_then_whole_passes(persistent, at)
    assert read_ahead_at_depth(deeper) == []


@pytest.mark.parametrize("workers,prefetch", [(1, 1), (2, 1), (1, 2), (3, 2), (2, 3), (4, 4), (1, 4)])
def test_workers_and_prefetch_mixed_sizes_across_the_4mb_threshold(deeper, workers, prefetch):
    tu.test_workers_and_prefetch_mixed_sizes_exact(workers, prefetch)
    assert read_ahead_at_depth(deeper) == []


@pytest.mark.parametrize("after", [0, 2])
def test_worker_killed_mid_pass(deeper, after):
    tu.test_worker_killed_mid_pass_gives_torchs_error_never_wrong_bytes(after)
    assert read_ahead_at_depth(deeper) == []


@pytest.mark.parametrize("after", [5, 6])
def test_worker_killed_near_the_end(deeper, after):
    tu.test_worker_killed_near_the_end_never_wrong_bytes(after)
    assert read_ahead_at_depth(deeper) == []


def test_very_slow_consumer_persistent_prefetch_1(deeper):
    tu.test_very_slow_consumer_with_persistent_workers_over_passes()
    assert read_ahead_at_depth(deeper) == []


def test_slow_consumer_same_order(deeper):
    tu.test_a_slow_consumer_gets_the_batches_in_order_unchanged()
    assert read_ahead_at_depth(deeper) == []


def test_kept_batches_exact_after_the_pass(deeper):
    tu.test_kept_batches_stay_exact_after_the_pass()
    assert read_ahead_at_depth(deeper) == []


def test_leave_inside_torchs_end_of_pass_shutdown(deeper, monkeypatch):
    tu.test_leave_while_the_thread_is_in_torchs_end_of_pass_shutdown(monkeypatch)
    assert read_ahead_at_depth(deeper) == []


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("at", [1, 9])
def test_shardstream_resume_mid_epoch(deeper, tmp_path, persistent, at):
    tu.test_shardstream_resume_mid_epoch_exact(tmp_path, persistent, at)
    assert read_ahead_at_depth(deeper) == []


def test_state_dict_after_leaving_persistent_pass(deeper, tmp_path):
    tu.test_state_dict_after_leaving_persistent_pass_then_resume_same_loader(tmp_path)
    assert read_ahead_at_depth(deeper) == []


# ---- test_vmread_patterns.py's iterable scenarios --------------------------------------------------------------------
def test_pause_while_a_finished_worker_holds_unread_batches(deeper):
    tv.test_a_pause_of_the_consumer_while_a_finished_worker_holds_unread_batches_loses_nothing()
    assert read_ahead_at_depth(deeper) == []


def test_shardstream_slow_steps_uneven_shards(deeper, tmp_path):
    tv.test_held_shardstream_slow_steps_uneven_shards(tmp_path)
    # 9 batches, prefetch_factor 4: each may be packed before reads begin
    assert read_ahead_at_depth(deeper, reads=False) == []


# ---- three batches in flight, reads slowed -------------------------------------------------------------------------
@pytest.mark.parametrize("workers,prefetch", [(1, 1), (2, 1), (2, 2)])
def test_three_batches_in_flight_with_slow_reads_stay_exact(deeper, monkeypatch, workers, prefetch):
    """Each read out of a worker's memory takes 100 ms longer, so the batch the consumer finishes and the two the
    thread started are all under way at once while the workers go on packing into their other segments (and, out
    of free segments, send through torch's pipe): a leaf a worker let go early would come back wrong or as a read
    error. (One worker, prefetch_factor 1: its 3 segments all busy, a batch goes through torch's pipe.)"""
    real = vmread._read

    def slow_read(*args):
        time.sleep(0.1)
        return real(*args)

    monkeypatch.setattr(vmread, "_read", slow_read)
    # batches of 4.8 MB, read in threads (a smaller one is read inside start(), in the thread that would start the
    # next: no deeper than before)
    loader = DataLoader(tu.Raw(96), batch_size=16, num_workers=workers, prefetch_factor=prefetch, collate_fn=tu.ident)
    for _ in range(2):
        got = list(loader)
        assert tu.keys(got) == tu.all_keys(workers, 96) and tu.wrong(got) == []
    assert tu.wait_gone() == 0
    assert read_ahead_at_depth(deeper) == []
    assert deeper.most == DEPTH + 1, deeper.most  # the deeper read-ahead was reached, not just configured
