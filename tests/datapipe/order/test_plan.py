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


def test_segments_read_like_a_list_of_segment():
    segs = Segments(np.array([4, 2]), np.array([0, 3]), np.array([5, 4]))
    assert list(segs) == [Segment(4, 0, 5), Segment(2, 3, 4)] and segs == [Segment(4, 0, 5), Segment(2, 3, 4)]
    assert segs[1] == Segment(2, 3, 4) and len(segs) == 2
