"""Under DDP with ``on_error="skip"``, a worker (or a whole rank) whose every sample is lost: the rank still yields
its planned count, repeating an exact, deterministic choice of its other samples (the same on a resume from any
state), or, when the rank has no readable sample at all, raises a ``DataError`` rather than a short epoch."""
import functools
import os

import pytest

from datapipe import DataError, ShardStream
from loaders import DataLoader
from tests.datapipe.order.test_elastic import run_rank
from tests.resume import assert_resumes_identically
from tests.shards import write_shards

# 4 shards of 3 samples, two ranks of 6; unshuffled, with 2 workers each worker reads one whole shard:
# rank 0: worker 0 s0-*, worker 1 s1-*; rank 1: worker 0 s2-*, worker 1 s3-*


def _damage(urls, shards, how):
    for i in shards:
        if how == "missing":
            os.remove(urls[i])
        else:
            with open(urls[i], "r+b") as f:
                f.write(b"\xff" * os.path.getsize(urls[i]))


@pytest.fixture(params=["missing", "corrupt"])
def damaged(request, tmp_path):
    """URLs with shard 1 (rank 0's worker 1's whole share) unreadable."""
    urls, _ = write_shards(tmp_path / "s", [3, 3, 3, 3])
    _damage(urls, [1], request.param)
    return urls


def _stream(urls, rank, *, shuffle=False, shuffle_buffer=0):
    stream = ShardStream(urls, on_error="skip", rank=rank, world_size=2, shuffle=shuffle,
                         shuffle_buffer=shuffle_buffer, seed=5)
    stream.set_epoch(1)
    return stream


def _keys(items):
    return [s["__key__"] for s in items]


def test_a_worker_whose_whole_share_is_lost_repeats_samples_of_its_rank(damaged):
    got = {rank: run_rank(_stream(damaged, rank), 2)[0] for rank in (0, 1)}
    assert [len(got[0]), len(got[1])] == [6, 6]
    assert sorted(got[1]) == [f"s{s}-{i:05d}" for s in (2, 3) for i in range(3)]
    assert not [k for k in got[0] if k.startswith("s1-")]
    assert sorted(set(got[0])) == [f"s0-{i:05d}" for i in range(3)]
    # the stand-in is the rank's first readable sample after the lost share (worker 0's first, here)
    assert sorted(got[0]) == sorted([f"s0-{i:05d}" for i in range(3)] + ["s0-00000"] * 3)


@pytest.mark.parametrize("shuffle,shuffle_buffer", [(False, 0), (True, 0), (True, 4)])
def test_the_repeats_for_a_lost_share_resume_exactly_from_every_step(damaged, shuffle, shuffle_buffer):
    make = functools.partial(_stream, damaged, shuffle=shuffle, shuffle_buffer=shuffle_buffer)
    for rank in (0, 1):
        full = run_rank(make(rank), 2)[0]
        assert len(full) == 6
        for k in range(7):
            head, state = run_rank(make(rank), 2, k)
            rest, _ = run_rank(make(rank), 2, state=state)
            assert head + rest == full, f"rank {rank} resumed after {k}"


def test_stats_count_the_repeats_and_the_loss_once(damaged):
    stream = _stream(damaged, 0)
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    assert len(list(loader)) == 6
    stats = loader.stats()
    assert stats["skipped"] == 3 and stats["padded"] == 3


@pytest.mark.parametrize("how", ["missing", "corrupt"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_rank_with_no_readable_sample_raises(tmp_path, how, num_workers):
    urls, _ = write_shards(tmp_path / "s", [3, 3, 3, 3])
    _damage(urls, [0, 1], how)  # all of rank 0's share
    loader = DataLoader(_stream(urls, 0), batch_size=2, num_workers=num_workers, collate_fn=_keys)
    with pytest.raises(DataError, match="no readable sample"):
        list(loader)
    other = DataLoader(_stream(urls, 1), batch_size=2, num_workers=num_workers, collate_fn=_keys)
    assert sum(len(b) for b in other) == 6  # the other rank is whole


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_ranks_yield_equal_batches_when_a_workers_share_is_lost(damaged, num_workers):
    """loaders.DataLoader, both ranks of a simulated world of 2: the same number of batches and samples."""
    counts = []
    for rank in (0, 1):
        make = functools.partial(DataLoader, _stream(damaged, rank), batch_size=2, num_workers=num_workers,
                                 collate_fn=_keys)
        batches = list(make())
        counts.append((len(batches), sum(len(b) for b in batches)))
    batches = 3 if num_workers == 0 else 4  # each worker batches its own 3 samples: 2 + 1
    assert counts == [(batches, 6), (batches, 6)]


def test_loader_resumes_the_repeats_of_a_lost_share_exactly(damaged):
    def make():
        return DataLoader(_stream(damaged, 0, shuffle=True, shuffle_buffer=2), batch_size=2, num_workers=2,
                          collate_fn=_keys)

    full = assert_resumes_identically(make, steps=(1, 2, 3))
    assert sum(len(b) for b in full) == 6


def test_a_lost_share_on_one_worker_rank_raises_only_when_the_rank_has_nothing(tmp_path):
    """Without workers a rank's share is one run: half of it lost is repaid from the rest, as before."""
    urls, _ = write_shards(tmp_path / "s", [3, 3, 3, 3])
    _damage(urls, [0], "corrupt")
    got = _keys(_stream(urls, 0))
    assert got == ["s1-00000"] * 4 + ["s1-00001", "s1-00002"]


def _fail_on(lost, sample):
    if sample["__key__"] in lost:
        raise ValueError("unreadable")
    return sample


def test_the_stand_in_passes_the_steps_and_its_search_counts_no_loss_twice(damaged):
    """The other worker's first sample fails the map: the stand-in is its next; the losses are counted once."""
    def make():
        return _stream(damaged, 0).map(functools.partial(_fail_on, frozenset(["s0-00000"])))

    full = run_rank(make(), 2)[0]
    # worker 0: s0-00001 twice (s0-00000 lost), s0-00002; worker 1 (shard 1 lost): s0-00001 three times
    assert sorted(full) == ["s0-00001"] * 5 + ["s0-00002"]
    loader = DataLoader(make(), batch_size=None, num_workers=2)
    assert len(list(loader)) == 6
    assert loader.stats()["skipped"] == 4 and loader.stats()["padded"] == 4
    for k in range(7):
        head, state = run_rank(make(), 2, k)
        rest, _ = run_rank(make(), 2, state=state)
        assert head + rest == full, f"resumed after {k}"
