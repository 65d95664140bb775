"""The epoch plan: shard order, and which samples each rank and DataLoader worker reads.

Shards are ordered (shuffled per epoch when asked), their samples numbered globally
``0..N-1``, and every rank gets ``ceil(N / world_size)`` sample slots over a contiguous run of
those numbers. Slots past the end of a rank's share wrap to the next samples, so every rank
yields the same count and at most ``world_size - 1`` samples are repeated per epoch. A rank's
slots are split into contiguous runs for its workers; every rank splits identically, so every
rank also yields the same number of batches.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Samples ``start <= i < stop`` of shard ``shard`` (an index into the URL list)."""

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WorkerPlan:
    segments: tuple[Segment, ...]
    padded: int  # how many of this worker's samples repeat samples of other ranks

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)


def epoch_seed(seed: int, epoch: int, *parts: int) -> int:
    """A stable 63-bit seed mixing ``seed``, ``epoch`` and further parts (rank, worker)."""
    return random.Random(repr((seed, epoch) + parts)).getrandbits(63)


def shard_order(num_shards: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    order = list(range(num_shards))
    if shuffle:
        random.Random(epoch_seed(seed, epoch)).shuffle(order)
    return order


def samples_per_rank(total: int, world_size: int) -> int:
    return -(-total // world_size) if total else 0


def worker_plan(counts: list[int], order: list[int], *, rank: int, world_size: int,
                worker: int, num_workers: int) -> WorkerPlan:
    """The segments that ``worker`` of ``rank`` reads, in reading order."""
    total = sum(counts)
    per_rank = samples_per_rank(total, world_size)
    if per_rank == 0:
        return WorkerPlan((), 0)
    rank_start = rank * total // world_size
    rank_real = (rank + 1) * total // world_size - rank_start
    slot_lo = per_rank * worker // num_workers
    slot_hi = per_rank * (worker + 1) // num_workers
    padded = max(0, slot_hi - max(slot_lo, rank_real))
    return WorkerPlan(tuple(_segments(counts, order, (rank_start + slot_lo) % total, slot_hi - slot_lo)), padded)


def _segments(counts: list[int], order: list[int], first: int, length: int) -> list[Segment]:
    """Segments covering global sample numbers ``first, first+1, ...`` (``length`` of them, wrapping)."""
    bounds, pos = [], 0
    for shard in order:
        bounds.append((pos, shard, counts[shard]))
        pos += counts[shard]
    total = pos
    out: list[Segment] = []
    g, left = first, length
    while left > 0:
        for lo, shard, n in bounds:
            if lo <= g < lo + n:
                take = min(left, lo + n - g)
                start = g - lo
                if out and out[-1].shard == shard and out[-1].stop == start:
                    out[-1] = Segment(shard, out[-1].start, start + take)
                else:
                    out.append(Segment(shard, start, start + take))
                left -= take
                g = (g + take) % total
                break
    return out
