"""The epoch plan as arrays: segments over the shard order, exactly once per epoch, equal per rank."""
import random

import numpy as np
import pytest

from datapipe.order.plan import Segment, Segments, run_ranges, shard_order, worker_plan


def _numbered(counts, order):
    """Global sample number -> (shard, index in shard), the plan's numbering written out."""
    return [(shard, i) for shard in order for i in range(counts[shard])]


@pytest.mark.parametrize("seed", range(6))
def test_segments_are_the_workers_slots_in_shard_order(seed):
    rnd = random.Random(seed)
    counts = [rnd.choice([0, 0, 1, 2, 5, 9]) for _ in range(rnd.randrange(1, 40))]
    order = shard_order(len(counts), shuffle=True, seed=seed, epoch=seed)
    numbered = _numbered(counts, order)
    world, workers = rnd.randrange(1, 5), rnd.randrange(1, 4)
    seen = []
    for rank in range(world):
        per_rank = 0
        for worker in range(workers):
            plan = worker_plan(counts, order, rank=rank, world_size=world, worker=worker, num_workers=workers)
            got = [(s.shard, i) for s in plan.segments for i in range(s.start, s.stop)]
            ranges, _ = run_ranges(((0, len(numbered)),) if numbered else (), rank=rank, world_size=world,
                                   worker=worker, num_workers=workers)
            assert got == [numbered[g] for lo, hi in ranges for g in range(lo, hi)]
            assert len(plan) == len(got) and all(len(s) > 0 for s in plan.segments)
            assert all(isinstance(v, int) for s in plan.segments for v in (s.shard, s.start, s.stop))
            per_rank += len(plan)
            seen += got
        assert per_rank == -(-len(numbered) // world)
    assert sorted(set(seen)) == sorted(numbered) and len(seen) - len(numbered) < world


def test_the_shard_order_is_a_seeded_permutation():
    a = shard_order(1000, shuffle=True, seed=3, epoch=1)
    assert sorted(a.tolist()) == list(range(1000))
    assert (a == shard_order(1000, shuffle=True, seed=3, epoch=1)).all()
    assert not (a == shard_order(1000, shuffle=True, seed=3, epoch=2)).all()
    assert shard_order(5, shuffle=False, seed=3, epoch=1).tolist() == [0, 1, 2, 3, 4]
    # the order checkpoints name (SHARD_ORDER): the same permutation as when it was named
    assert list(shard_order(10, shuffle=True, seed=0, epoch=0)) == [1, 2, 4, 3, 5, 7, 8, 6, 0, 9]
    assert np.asarray(shard_order(12, shuffle=True, seed=5, epoch=3)).tolist() == [4, 3, 1, 7, 8, 10, 0, 2, 11, 9, 5, 6]


@pytest.mark.parametrize("seed", range(8))
def test_a_plan_over_the_lazy_order_is_the_plan_over_the_whole_permutation(seed):
    rnd = random.Random(seed)
    n = rnd.choice([2, 3, 40, 700, 5000])
    order = shard_order(n, shuffle=True, seed=seed, epoch=1)
    for _ in range(2):  # the same order over other counts: its key buckets made again
        counts = np.array([rnd.choice([0, 0, 1, 2, 7]) for _ in range(n)], dtype=rnd.choice([np.int32, np.int64]))
        total = int(counts.sum())
        cuts = sorted(rnd.sample(range(total + 1), min(total + 1, 2 * rnd.randrange(1, 12))))
        for base in (None, list(zip(cuts[::2], cuts[1::2]))):  # the epoch, or an elastic resume's rest
            world, workers = rnd.randrange(1, 6), rnd.randrange(1, 4)
            for rank in range(world):
                for worker in range(workers):
                    args = dict(rank=rank, world_size=world, worker=worker, num_workers=workers, base=base)
                    lazy, whole = worker_plan(counts, order, **args), worker_plan(counts, np.asarray(order), **args)
                    assert list(lazy.segments) == list(whole.segments) and lazy.padded == whole.padded


def test_segments_read_like_a_list_of_segment():
    segs = Segments(np.array([4, 2]), np.array([0, 3]), np.array([5, 4]))
    assert list(segs) == [Segment(4, 0, 5), Segment(2, 3, 4)] and segs == [Segment(4, 0, 5), Segment(2, 3, 4)]
    assert segs[1] == Segment(2, 3, 4) and len(segs) == 2
