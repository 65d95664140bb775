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

    def sample_at(self, position: int) -> "WorkerPlan":
        """The plan of the one sample at ``position`` of this run (to read it again, alone)."""
        left = position
        for seg in self.segments:
            if left < len(seg):
                return WorkerPlan([Segment(seg.shard, seg.start + left, seg.start + left + 1)], 0)
            left -= len(seg)
        raise IndexError(f"position {position} is past the end of this worker's run of {len(self)}")


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


# names the shuffled shard order below; a checkpoint records it, and one taken under another order (or before
# the name was recorded: an earlier, numpy.random order) is refused instead of resuming into other shards
SHARD_ORDER = "splitmix64-sort"


def shard_order(num_shards: int, *, shuffle: bool, seed: int, epoch: int) -> "ShardOrder | np.ndarray":
    """The epoch's shard order (URL indexes): a seeded permutation (a :class:`ShardOrder`) when ``shuffle``, else
    URL order (an int64 ``arange``).

    The permutation sorts the shards by splitmix64 keys of (seed, epoch, index): array arithmetic, no Python
    loop and no ``numpy.random`` (whose import alone costs a first batch ~0.15 s).
    """
    if not shuffle or num_shards < 2:
        return np.arange(num_shards, dtype=np.int64)
    return ShardOrder(num_shards, derive_seed(seed, epoch) & 0xFFFFFFFFFFFFFFFF)


_BLOCK = 1 << 16  # shards whose keys are made at a time (a block's arrays stay in the core's cache)


class ShardOrder(Sequence[int]):
    """A shuffled shard order, made only as far as it is read: :func:`worker_plan` sorts just the keys of the
    shards one worker reads (the order of a million shards is not made in every worker, nor read at random);
    ``np.asarray(order)``, iteration and indexing give the whole permutation (int64, made once)."""

    def __init__(self, num_shards: int, offset: int):
        self.num_shards, self.offset = num_shards, offset
        self._array: np.ndarray | None = None
        self._cached: tuple | None = None  # (counts, _buckets(counts))

    def keys(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The sort keys (uint64, all distinct: splitmix64 is a bijection) of shards ``lo <= i < hi``."""
        return self._mix(np.arange(lo + 1, (self.num_shards if hi is None else hi) + 1, dtype=np.uint64))

    def keys_of(self, shards: np.ndarray) -> np.ndarray:
        """The sort keys of the shards ``shards`` (an integer array)."""
        return self._mix(shards.astype(np.uint64) + np.uint64(1))

    def _mix(self, z: np.ndarray) -> np.ndarray:
        z *= _GOLDEN
        z += np.uint64(self.offset)
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
        return z

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.argsort(self.keys(), kind="stable")
        return self._array

    def __array__(self, dtype=None, copy=None):
        return self.array() if dtype is None else self.array().astype(dtype)

    def __len__(self) -> int:
        return self.num_shards

    def __getitem__(self, i):
        return self.array()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.array().tolist())

    def tolist(self) -> list[int]:
        return self.array().tolist()

    def __eq__(self, other):
        return self.array() == np.asarray(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"ShardOrder({self.num_shards} shards, offset {self.offset:#x})"

    def _buckets(self, counts: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """``(bits, bucket, bucket_starts)``: each shard's key bucket (its key's top ``bits``) and the first global
        sample number of each bucket (one more entry: the total), made once for the counts (every worker of
        the epoch plans over the same)."""
        if self._cached is not None and self._cached[0] is counts:
            return self._cached[1]
        n = self.num_shards
        bits = min(24, max(1, (n // 16).bit_length()))  # ~16 shards per bucket
        shift = np.uint64(64 - bits)
        buckets = np.empty(n, dtype=np.uint16 if bits <= 16 else np.uint32)
        per_bucket = np.zeros(1 << bits, dtype=np.float64)  # exact: a total under 2**53 (checked by the caller)
        for lo in range(0, n, _BLOCK):
            hi = min(n, lo + _BLOCK)
            block = buckets[lo:hi]
            block[:] = self.keys(lo, hi) >> shift
            per_bucket += np.bincount(block, weights=counts[lo:hi], minlength=1 << bits)
        bucket_starts = np.zeros((1 << bits) + 1, dtype=np.int64)
        np.cumsum(per_bucket.astype(np.int64), out=bucket_starts[1:])
        self._cached = (counts, (bits, buckets, bucket_starts))
        return self._cached[1]

    def window(self, counts: np.ndarray, ranges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(shards, sizes, starts)`` in this order of the non-empty shards that hold the global sample numbers of
        ``ranges`` (and others of the same key buckets): ``starts`` are their first global numbers. One pass over
        the keys, a block at a time (each shard's key bucket and the samples per bucket), a pass over the buckets
        wanted, and one sort of the shards found: no random reads over all shards."""
        bits, buckets, bucket_starts = self._buckets(counts)
        shift = np.uint64(64 - bits)
        edges = np.array([(g, stop - 1) for g, stop in ranges if stop > g], dtype=np.int64).reshape(-1, 2)
        first, last = (np.searchsorted(bucket_starts, edges, side="right") - 1).T
        wanted = np.zeros((1 << bits) + 1, dtype=np.int64)  # +1 at a run's first bucket, -1 past its last
        np.add.at(wanted, first, 1)
        np.add.at(wanted, last + 1, -1)
        shards = np.flatnonzero((np.cumsum(wanted[:-1]) > 0)[buckets])
        shards = shards[counts[shards] > 0]
        keys = self.keys_of(shards)
        by_bucket = np.argsort(buckets[shards], kind="stable")  # a radix sort (16-bit buckets): linear
        by_key = by_bucket[np.argsort(keys[by_bucket], kind="stable")]  # runs of ~16; distinct keys: one order
        shards, keys = shards[by_key], keys[by_key]
        sizes = counts[shards].astype(np.int64)
        bucket = (keys >> shift).astype(np.int64)
        before = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=before[1:])
        first_of = np.zeros(len(sizes), dtype=np.int64)  # each shard's bucket's first shard found
        new = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
        first_of[new] = new
        np.maximum.accumulate(first_of, out=first_of)
        return shards, sizes, bucket_starts[bucket] + before - before[first_of]


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


def _segments(counts: np.ndarray, order: Sequence[int], ranges: list[tuple[int, int]]) -> Segments:
    """Segments covering the global sample numbers of ``ranges``, in that order (array arithmetic: a
    search per range end, no loop over the shards). A :class:`ShardOrder` gives only the shards the ranges
    reach (:meth:`ShardOrder.window`); another order is read whole."""
    if isinstance(order, ShardOrder) and len(order) == len(counts) and int(counts.sum(dtype=np.int64)) < 2**53:
        shards, sizes, starts = order.window(counts, ranges)
    else:
        shards = np.asarray(order, dtype=np.int64)
        sizes = counts[shards] if len(shards) else np.zeros(0, np.int64)
        if not sizes.all():  # empty shards take no slot
            keep = sizes > 0
            shards, sizes = shards[keep], sizes[keep]
        wide = np.int32 if int(sizes.sum(dtype=np.int64)) < 2**31 else np.int64  # half the memory where it fits
        starts = np.zeros(len(sizes), dtype=wide)
        np.cumsum(sizes[:-1], dtype=wide, out=starts[1:])
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
