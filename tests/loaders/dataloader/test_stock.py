"""loaders.dataloader.stock: raw segments that outlive a pass's workers, for the next pass's fresh workers."""
import multiprocessing
import time

import pytest
import torch

from loaders import DataLoader
from loaders.dataloader.rawshm import RawCopies, _Mapped
from loaders.dataloader.shm import _STATE, BUSY, FREE, HEADER, MAPPED, SegmentPool, recycling_available
from loaders.dataloader.stock import SegmentStock, forks
from tests.loaders.dataloader.test_rawshm import Raw, as_list, same, sample

pytestmark = pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")


class Process:
    def __init__(self, alive):
        self.alive = alive

    def is_alive(self):
        return self.alive


def mapped(nbytes=4096):
    storage = torch.UntypedStorage._new_shared(HEADER + nbytes)
    return _Mapped(torch.empty(0, dtype=torch.uint8).set_(storage, HEADER, (nbytes,), (1,)))


def copies_with(n, *, processes):
    copies = RawCopies(b"stockmk!", workers=2, batches=4)
    copies.processes = processes
    for i in range(n):
        entry = mapped()
        entry.header[_STATE] = BUSY  # one was in flight as the pass ended
        copies.kept[("pid", 7, i)] = entry
    return copies


def test_a_pass_gives_its_segments_back_only_once_every_worker_is_gone():
    stock = SegmentStock()
    assert not stock.fill(copies_with(2, processes=[Process(False), Process(True)]))  # one may still write
    assert not stock.fill(copies_with(2, processes=None))  # not a pass that stocks (persistent, spawn, tensors)
    assert len(stock) == 0
    copies = copies_with(3, processes=[Process(False), Process(False)])
    assert stock.fill(copies) and len(stock) == 3 and not copies.kept
    assert all(int(e.header[_STATE]) == FREE and int(e.header[MAPPED]) == 1 for _, e in stock.entries)


def test_the_next_pass_splits_them_among_its_workers_and_keeps_them_under_their_tokens():
    stock = SegmentStock()
    stock.fill(copies_with(5, processes=[Process(False)]))
    nxt = RawCopies(b"nextmrk!", workers=2, batches=4)
    shares = stock.hand_out(nxt, 2)
    assert [len(s) for s in shares] == [3, 2] and len(stock) == 0 and stock.reused == 5
    tokens = [t for share in shares for t, _ in share]
    assert sorted(tokens) == sorted(nxt.kept) and len(set(tokens)) == 5  # each segment to one worker alone
    assert all(nxt.received(t, (), None).storage is s for share in shares for t, s in share)
    assert SegmentStock().hand_out(nxt, 2) is None  # nothing kept: nothing handed out


def test_a_pool_adopts_them_free_and_names_them_by_their_tokens():
    stock = SegmentStock()
    stock.fill(copies_with(2, processes=[Process(False)]))
    (share,) = stock.hand_out(RawCopies(b"nextmrk!", workers=1, batches=4), 1)
    pool = SegmentPool(b"poolmrk!", cap=4)
    pool.adopt(share)
    taken = pool.take(1000)
    assert taken is not None and pool.fresh == 0  # an adopted one, none made
    token, header = pool.number(taken)
    assert token in [t for t, _ in share] and int(header[_STATE]) == BUSY and int(header[MAPPED]) == 1
    assert bytes(header[:8].tolist()) == b"poolmrk!"


@pytest.mark.parametrize("context, expected", [("fork", True), ("spawn", False), ("forkserver", False),
                                               (multiprocessing.get_context("spawn"), False)])
def test_only_forked_workers_inherit_segments(context, expected):
    assert forks(context) is expected


def test_forked_workers_by_default_where_the_process_forks():
    assert forks(None) is (multiprocessing.get_context().get_start_method() == "fork")


@pytest.mark.parametrize("workers", [1, 2])
def test_fresh_workers_pass_after_pass_reuse_the_segments_and_every_batch_is_exact(workers):
    if not forks(None):
        pytest.skip("the default start method does not fork")
    reference = [sample(i) for i in range(32 * 9)]
    dl = DataLoader(Raw(32 * 9), batch_size=32, num_workers=workers, collate_fn=as_list, prefetch_factor=2)
    for _ in range(4):
        got = list(dl)  # every batch held to the end of the pass: a segment written twice would show
        time.sleep(0.05)
        assert len(got) == 9 and all(same(b, reference[32 * i:32 * (i + 1)]) for i, b in enumerate(got))
    assert dl._stock.reused > 0  # the later passes' workers started with the earlier ones' segments
    dl.close()
    assert len(dl._stock) == 0


def test_an_early_break_then_a_new_pass_and_two_passes_side_by_side_stay_exact():
    if not forks(None):
        pytest.skip("the default start method does not fork")
    reference = [sample(i) for i in range(32 * 9)]
    dl = DataLoader(Raw(32 * 9), batch_size=32, num_workers=2, collate_fn=as_list, prefetch_factor=2)
    for b, batch in enumerate(dl):
        assert same(batch, reference[32 * b:32 * (b + 1)])
        if b == 2:
            break  # the workers had batches in flight in their segments
    a, b = iter(dl), iter(dl)  # two passes at once: never one segment between them
    got_a, got_b = [], []
    for x, y in zip(a, b):
        got_a.append(x)
        got_b.append(y)
    for got in (got_a, got_b):
        assert len(got) == 9 and all(same(x, reference[32 * i:32 * (i + 1)]) for i, x in enumerate(got))
    assert all(same(x, reference[32 * i:32 * (i + 1)]) for i, x in enumerate(list(dl)))


def test_persistent_workers_keep_their_own_and_stock_nothing():
    dl = DataLoader(Raw(32 * 6), batch_size=32, num_workers=2, collate_fn=as_list, persistent_workers=True)
    for _ in range(2):
        assert len(list(dl)) == 6
    assert len(dl._stock) == 0 and dl._stock.reused == 0
    dl.close()


def test_the_stock_keeps_one_passs_worth_the_largest_and_unmaps_the_rest():
    stock = SegmentStock()
    small = copies_with(6, processes=[Process(False)])  # workers=2 x batches=4: room for 8
    big = RawCopies(b"bigmark!", workers=2, batches=4)
    big.processes = [Process(False)]
    for i in range(4):
        big.kept[("big", i)] = mapped(8192)
    smalls = list(small.kept.values())
    assert stock.fill(small) and stock.fill(big) and len(stock) == 8 and not small.kept and not big.kept
    assert sum(t[0] == "big" for t, _ in stock.entries) == 4  # the largest stay
    kept = {id(e) for _, e in stock.entries}
    dropped = [e for e in smalls if id(e) not in kept]
    assert len(dropped) == 2 and all(int(e.header[MAPPED]) == 0 for e in dropped)  # unmapped once let go


def test_two_passes_at_once_again_and_again_hold_no_more_than_one_passs_worth():
    if not forks(None):
        pytest.skip("the default start method does not fork")
    dl = DataLoader(Raw(32 * 4), batch_size=32, num_workers=2, collate_fn=as_list, prefetch_factor=2)
    for _ in range(5):
        a, b = iter(dl), iter(dl)
        assert [len(x) for x in a] == [32] * 4 and [len(y) for y in b] == [32] * 4
        del a, b
        assert len(dl._stock) <= 2 * (2 + 2)  # workers x (prefetch factor + 2)
    dl.close()
