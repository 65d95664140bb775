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
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

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


class Segments(Sequence[Segment]):
    """A plan's segments, held as three integer arrays (shard, start, stop); ``Segment`` objects are made
    only as they are read, so a plan over a million shards costs arrays, not objects."""

    __slots__ = ("shard", "start", "stop")

    def __init__(self, shard: np.ndarray, start: np.ndarray, stop: np.ndarray):
        self.shard, self.start, self.stop = shard, start, stop

    def __len__(self) -> int:
        return len(self.shard)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        return Segment(int(self.shard[i]), int(self.start[i]), int(self.stop[i]))

    def __iter__(self) -> Iterator[Segment]:
        for lo in range(0, len(self.shard), 4096):  # Python ints, made a block at a time
            block = zip(self.shard[lo:lo + 4096].tolist(), self.start[lo:lo + 4096].tolist(),
                        self.stop[lo:lo + 4096].tolist())
            for shard, start, stop in block:
                yield Segment(shard, start, stop)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"Segments({len(self)} segments)"


@dataclass(frozen=True)
class WorkerPlan:
    segments: Sequence[Segment]
    padded: int  # how many of this worker's samples repeat samples of other ranks
    ranges: tuple[tuple[int, int], ...] = ()  # the global sample numbers read, in reading order

    def __len__(self) -> int:
        segments = self.segments
        if isinstance(segments, Segments):
            return int((segments.stop - segments.start).sum())
        return sum(len(s) for s in segments)


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


# names the shuffled shard order below; a checkpoint records it, and one taken under another order (or before
# the name was recorded: an earlier, numpy.random order) is refused instead of resuming into other shards
SHARD_ORDER = "splitmix64-sort"


def shard_order(num_shards: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The epoch's shard order (URL indexes, int64): a seeded permutation when ``shuffle``, else URL order.

    The permutation sorts the shards by splitmix64 keys of (seed, epoch, index): array arithmetic, no Python
    loop and no ``numpy.random`` (whose import alone costs a first batch ~0.15 s).
    """
    if not shuffle or num_shards < 2:
        return np.arange(num_shards, dtype=np.int64)
    z = np.arange(1, num_shards + 1, dtype=np.uint64)
    z *= _GOLDEN
    z += np.uint64(derive_seed(seed, epoch) & 0xFFFFFFFFFFFFFFFF)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return np.argsort(z, kind="stable")


def samples_per_rank(total: int, world_size: int) -> int:
    return -(-total // world_size) if total else 0


def worker_plan(counts: list[int], order: list[int], *, rank: int, world_size: int,
                worker: int, num_workers: int, base: Ranges | None = None) -> WorkerPlan:
    """The segments that ``worker`` of ``rank`` reads, in reading order.

    ``base``: the global sample numbers to plan over, as sorted ``(start, stop)`` ranges (default
    the whole epoch ``0..N-1``); an elastic resume plans the epoch's undelivered samples this way.
    """
    counts = np.asarray(counts)
    if counts.dtype.kind not in "iu":
        counts = counts.astype(np.int64)
    total = int(counts.sum(dtype=np.int64))
    if base is None:
        base = ((0, total),) if total else ()
    ranges, padded = run_ranges(base, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)
    return WorkerPlan(_segments(counts, order, ranges), padded, tuple(ranges))


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


def _segments(counts: Sequence[int], order: Sequence[int], ranges: list[tuple[int, int]]) -> Segments:
    """Segments covering the global sample numbers of ``ranges``, in that order (array arithmetic: a
    search per range end, no loop over the shards)."""
    ordered = np.asarray(order, dtype=np.int64)
    sizes = np.asarray(counts)[ordered] if len(ordered) else np.zeros(0, np.int64)
    shards = ordered
    if not sizes.all():  # empty shards take no slot
        keep = sizes > 0
        shards, sizes = ordered[keep], sizes[keep]
    total = int(sizes.sum(dtype=np.int64))
    wide = np.int32 if total < 2**31 else np.int64  # half the memory where the epoch's numbers fit
    starts = np.zeros(len(sizes) + 1, dtype=wide)
    np.cumsum(sizes, dtype=wide, out=starts[1:])
    parts_shard, parts_start, parts_stop = [], [], []
    for g, stop in ranges:
        if stop <= g:
            continue
        i0 = int(np.searchsorted(starts, g, side="right")) - 1
        i1 = int(np.searchsorted(starts, stop - 1, side="right")) - 1
        seg_start = np.zeros(i1 - i0 + 1, dtype=np.int64)
        seg_stop = sizes[i0:i1 + 1].astype(np.int64)
        seg_start[0] = g - starts[i0]
        seg_stop[-1] = stop - starts[i1]
        seg_shard = shards[i0:i1 + 1]
        if parts_shard and parts_shard[-1][-1] == seg_shard[0] and parts_stop[-1][-1] == seg_start[0]:
            parts_stop[-1] = parts_stop[-1].copy()
            parts_stop[-1][-1] = seg_stop[0]  # the run goes on in the same shard: one segment
            seg_shard, seg_start, seg_stop = seg_shard[1:], seg_start[1:], seg_stop[1:]
        parts_shard.append(seg_shard)
        parts_start.append(seg_start)
        parts_stop.append(seg_stop)
    if not parts_shard:
        empty = np.zeros(0, dtype=np.int64)
        return Segments(empty, empty, empty)
    return Segments(np.concatenate(parts_shard), np.concatenate(parts_start), np.concatenate(parts_stop))


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
