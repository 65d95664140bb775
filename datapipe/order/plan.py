"""The epoch plan: shard order, and which samples each rank and DataLoader worker reads.

Shards are ordered (shuffled per epoch when asked), their samples numbered globally
``0..N-1``, and every rank gets ``ceil(N / world_size)`` sample slots over a contiguous run of
those numbers. Slots past the end of a rank's share wrap to the next samples, so every rank
yields the same count and at most ``world_size - 1`` samples are repeated per epoch. A rank's
slots are split into contiguous runs for its workers; every rank splits identically, so every
rank also yields the same number of batches.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import Sequence

from datapipe.order.seeds import derive_seed

Ranges = Sequence[tuple[int, int]]


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
    ranges: tuple[tuple[int, int], ...] = ()  # the global sample numbers read, in reading order

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)



def shard_order(num_shards: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    order = list(range(num_shards))
    if shuffle:
        random.Random(derive_seed(seed, epoch)).shuffle(order)
    return order


def samples_per_rank(total: int, world_size: int) -> int:
    return -(-total // world_size) if total else 0


def worker_plan(counts: list[int], order: list[int], *, rank: int, world_size: int,
                worker: int, num_workers: int, base: Ranges | None = None) -> WorkerPlan:
    """The segments that ``worker`` of ``rank`` reads, in reading order.

    ``base``: the global sample numbers to plan over, as sorted ``(start, stop)`` ranges (default
    the whole epoch ``0..N-1``); an elastic resume plans the epoch's undelivered samples this way.
    """
    total = sum(counts)
    if base is None:
        base = ((0, total),) if total else ()
    ranges, padded = run_ranges(base, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)
    return WorkerPlan(tuple(_segments(counts, order, ranges)), padded, tuple(ranges))


def run_ranges(base: Ranges, *, rank: int, world_size: int, worker: int,
               num_workers: int) -> tuple[list[tuple[int, int]], int]:
    """The global numbers (ranges, reading order) of ``worker`` of ``rank`` over ``base``, and its padding.

    ``base`` read in order is the epoch's slot sequence: each rank gets ``ceil(T / world_size)``
    contiguous slots (wrapping past the end), split into contiguous runs for its workers.
    """
    total = sum(hi - lo for lo, hi in base)
    per_rank = samples_per_rank(total, world_size)
    if per_rank == 0:
        return [], 0
    rank_start = rank * total // world_size
    rank_real = (rank + 1) * total // world_size - rank_start
    slot_lo = per_rank * worker // num_workers
    slot_hi = per_rank * (worker + 1) // num_workers
    padded = max(0, slot_hi - max(slot_lo, rank_real))
    return take(base, (rank_start + slot_lo) % total, slot_hi - slot_lo), padded


def take(base: Ranges, first: int, length: int) -> list[tuple[int, int]]:
    """Global ranges of slots ``first, first+1, ...`` (``length`` of them, wrapping) of ``base`` read in order."""
    starts, pos = [], 0
    for lo, hi in base:
        starts.append(pos)
        pos += hi - lo
    total = pos
    out: list[tuple[int, int]] = []
    v, left = first, length
    while left > 0:
        i = bisect.bisect_right(starts, v) - 1
        while base[i][1] - base[i][0] == 0:
            i += 1
        lo, hi = base[i]
        g = lo + v - starts[i]
        n = min(left, hi - g)
        if out and out[-1][1] == g:
            out[-1] = (out[-1][0], g + n)
        else:
            out.append((g, g + n))
        left -= n
        v = (v + n) % total
    return out


def _segments(counts: list[int], order: list[int], ranges: list[tuple[int, int]]) -> list[Segment]:
    """Segments covering the global sample numbers of ``ranges``, in that order."""
    starts, shards, pos = [], [], 0
    for shard in order:
        if counts[shard]:
            starts.append(pos)
            shards.append(shard)
            pos += counts[shard]
    out: list[Segment] = []
    for g, stop in ranges:
        while g < stop:
            i = bisect.bisect_right(starts, g) - 1
            shard, lo = shards[i], starts[i]
            n = min(stop, lo + counts[shard]) - g
            start = g - lo
            if out and out[-1].shard == shard and out[-1].stop == start:
                out[-1] = Segment(shard, out[-1].start, start + n)
            else:
                out.append(Segment(shard, start, start + n))
            g += n
    return out


# ---- sets of global sample numbers, as sorted disjoint (start, stop) ranges ----------------------
def normalize(ranges) -> list[tuple[int, int]]:
    """Sorted, merged, non-empty ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def subtract(a: Ranges, b: Ranges) -> list[tuple[int, int]]:
    """``a`` minus ``b`` (both normalised)."""
    out: list[tuple[int, int]] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while lo < hi and k < len(b) and b[k][0] < hi:
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
        if lo < hi:
            out.append((lo, hi))
    return out


def map_positions(ranges: Ranges, positions: Ranges) -> list[tuple[int, int]]:
    """Global ranges of a run's positions: ``ranges`` is the run (reading order), ``positions`` sorted ranges."""
    out: list[tuple[int, int]] = []
    starts, pos = [], 0
    for lo, hi in ranges:
        starts.append(pos)
        pos += hi - lo
    for p, q in positions:
        while p < q:
            i = bisect.bisect_right(starts, p) - 1
            lo, hi = ranges[i]
            g = lo + p - starts[i]
            n = min(q - p, hi - g)
            out.append((g, g + n))
            p += n
    return out
