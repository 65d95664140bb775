"""Offline bin packing of sequence lengths into fixed-capacity bins.

Every algorithm works on the histogram of lengths (lengths are integers <= capacity), so the
Python-level work grows with the number of distinct lengths and remaining-capacity levels, not
with the number of items: a million lengths pack in a fraction of a second.

- ``"bfd"`` best-fit decreasing: items longest first; each goes to the open bin with the least
  remaining room that still fits it (ties: the lowest bin number), else a new bin.
- ``"ffd"`` first-fit decreasing: items longest first; each goes to the lowest-numbered bin that
  fits it, else a new bin.
- ``"spfhp"`` shortest-pack-first histogram packing (Krell et al., 2021): lengths longest first;
  a sequence goes to the pack with the *most* room left that fits it, one sequence per pack per
  sweep; sequences that fit nowhere open one pack each.

Results are deterministic: equal lengths are placed in index order. Bins are numbered in the
order they were opened; inside a bin, items are in placement order (longest first).
"""
from __future__ import annotations

import gc
from bisect import bisect_left, bisect_right, insort
from itertools import chain
from typing import Iterable

import numpy as np

ALGORITHMS = ("bfd", "ffd", "spfhp")
SPLITS = (None, "chunk")


def pack_lengths(lengths: Iterable[int], capacity: int, *, algorithm: str = "bfd",
                 split: str | None = None) -> list[list]:
    """Pack items of the given lengths into bins of ``capacity``; returns the bins.

    Without ``split``, each bin is a list of item indices; every index appears exactly once and
    every bin's total length is <= ``capacity``. An item longer than ``capacity`` is a
    ``ValueError``.

    ``split="chunk"``: items longer than ``capacity`` are cut into pieces of ``capacity`` tokens
    (each fills a bin of its own) plus a remainder that is packed like any other item. Every bin
    entry is then a tuple ``(index, start, end)`` naming the slice ``[start, end)`` of item
    ``index`` (also for items that were not cut); the slices of one item tile it exactly.

    Zero-length items are placed in bin 0.
    """
    capacity = _check_capacity(capacity)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use None (long items are an error) or 'chunk'")
    lens = _as_lengths(lengths)
    if split is None:
        too_long = np.flatnonzero(lens > capacity)
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"item {i} has length {int(lens[i])} > capacity {capacity} "
                f"({too_long.size} such items); truncate them first or pass split='chunk'")
        return _pack(lens, capacity, algorithm)
    return _pack_chunked(lens, capacity, algorithm)


def _check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    return int(capacity)


def _as_lengths(lengths) -> np.ndarray:
    if not isinstance(lengths, (np.ndarray, list, tuple)):
        lengths = list(lengths)  # any iterable of ints
    arr = np.asarray(lengths)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.dtype.kind == "f" and np.all(np.floor(arr) == arr):
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise ValueError(f"lengths must be >= 0; item {int(neg[0])} has length {int(arr[neg[0]])}")
    return arr


def _pack_chunked(lens: np.ndarray, cap: int, algorithm: str) -> list[list[tuple[int, int, int]]]:
    npieces = np.maximum(1, -(-lens // cap))  # ceil, at least one piece (zero-length items)
    owner = np.repeat(np.arange(lens.size), npieces)
    first = np.repeat(np.cumsum(npieces) - npieces, npieces)
    k = np.arange(owner.size) - first
    start = k * cap
    end = np.minimum(start + cap, lens[owner])
    bins = _pack(end - start, cap, algorithm)
    o, s, e = owner.tolist(), start.tolist(), end.tolist()
    return [[(o[p], s[p], e[p]) for p in b] for b in bins]


def _pack(lens: np.ndarray, cap: int, algorithm: str) -> list[list[int]]:
    n = lens.size
    if n == 0:
        return []
    positive = lens > 0
    if positive.all():
        idx = None
        plens = lens
    else:
        idx = np.flatnonzero(positive)
        plens = lens[idx]
    if plens.size:
        order, item_bin, nbins = _PACKERS[algorithm](plens, cap)
        bins = _group(order, item_bin, nbins)
        if idx is not None:
            m = idx.tolist()
            bins = [[m[i] for i in b] for b in bins]
    else:
        bins = [[]]
    if idx is not None:
        bins[0].extend(np.flatnonzero(~positive).tolist())
    return bins


def _decreasing(lens: np.ndarray, cap: int):
    """Item order (longest first, ties by index) and the distinct lengths with their counts."""
    keys = cap - lens
    order = np.argsort(keys.astype(np.uint16) if cap < 65536 else keys, kind="stable")
    hist = np.bincount(lens, minlength=cap + 1)
    distinct = np.flatnonzero(hist)[::-1]
    return order, distinct.tolist(), hist[distinct].tolist()


def _group(order: np.ndarray, item_bin: np.ndarray, nbins: int) -> list[list[int]]:
    """Bins as lists of item indices; ``item_bin[k]`` is the bin of item ``order[k]``."""
    perm = np.argsort(item_bin, kind="stable")
    items = order[perm].tolist()
    ends = np.cumsum(np.bincount(item_bin, minlength=nbins)).tolist()
    # Building ~10^5 small lists triggers the cyclic GC over and over (3x slower); these lists
    # cannot form cycles, so pause it while they are built.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return list(map(items.__getitem__, map(slice, [0] + ends[:-1], ends)))
    finally:
        if enabled:
            gc.enable()


class _Levels:
    """Open bins grouped by remaining room; each level's bins sorted by bin number."""

    def __init__(self, floor: int):
        self.floor = floor  # levels below the shortest item are dead: never stored
        self.bins: dict[int, list[int]] = {}  # level -> bin ids, descending (lowest id last)
        self.keys: list[int] = []  # sorted levels that hold bins
        self.dirty: set[int] = set()

    def add(self, level: int, ids: list[int]) -> None:
        if level < self.floor or not ids:
            return
        lst = self.bins.get(level)
        if lst is None:
            self.bins[level] = ids[::-1]
            insort(self.keys, level)
        else:
            lst.extend(ids)
            self.dirty.add(level)

    def take(self, level: int) -> list[int]:
        lst = self.bins[level]
        if level in self.dirty:
            lst.sort(reverse=True)
            self.dirty.discard(level)
        return lst

    def drop(self, level: int) -> None:
        del self.bins[level]
        self.keys.pop(bisect_left(self.keys, level))
        self.dirty.discard(level)


class _Steps:
    """Records placements: each step gives ``q`` consecutive items to each of some bins."""

    def __init__(self):
        self.bins: list[list[int]] = []
        self.reps: list[int] = []

    def add(self, ids: list[int], q: int) -> None:
        if ids:
            self.bins.append(ids)
            self.reps.append(q)

    def item_bins(self) -> np.ndarray:
        sizes = [len(b) for b in self.bins]
        ids = np.fromiter(chain.from_iterable(self.bins), dtype=np.int64, count=sum(sizes))
        return np.repeat(ids, np.repeat(np.asarray(self.reps, dtype=np.int64), sizes))


def _bfd(lens: np.ndarray, cap: int):
    order, distinct, counts = _decreasing(lens, cap)
    levels, steps, nbins = _Levels(distinct[-1]), _Steps(), 0
    for length, c in zip(distinct, counts):
        keys = levels.keys
        i = bisect_left(keys, length)
        while c and i < len(keys):
            r = keys[i]
            q = r // length
            lst = levels.take(r)
            if c >= len(lst) * q:  # every bin on this level takes q items
                taken = lst[::-1]
                c -= len(taken) * q
                levels.drop(r)
                steps.add(taken, q)
                levels.add(r - q * length, taken)
                i = bisect_right(keys, r)
            else:
                full, k = divmod(c, q)
                if full:
                    taken = lst[len(lst) - full:][::-1]
                    del lst[len(lst) - full:]
                    steps.add(taken, q)
                    levels.add(r - q * length, taken)
                if k:
                    b = lst.pop()
                    steps.add([b], k)
                    if not lst:
                        levels.drop(r)
                    levels.add(r - k * length, [b])
                elif not lst:
                    levels.drop(r)
                c = 0
        if c:  # open new bins; each takes as many items as fit
            q = cap // length
            full, k = divmod(c, q)
            ids = list(range(nbins, nbins + full))
            steps.add(ids, q)
            levels.add(cap - q * length, ids)
            nbins += full
            if k:
                steps.add([nbins], k)
                levels.add(cap - k * length, [nbins])
                nbins += 1
    return order, steps.item_bins(), nbins


def _fill_run(first: int, c: int, per_bin: int, room: int, length: int, pieces: list, reps: list):
    """Put ``c`` items of ``length`` into bins ``first, first+1, ...`` that each have ``room`` left,
    ``per_bin`` to a bin: full bins then one partial. Records the placements in ``pieces`` / ``reps``
    and returns the new (start, count, level) runs and how many bins were used."""
    full, k = divmod(c, per_bin)
    new = []
    if full:
        new.append((first, full, room - per_bin * length))
        pieces.append(np.arange(first, first + full))
        reps.append(np.full(full, per_bin))
    if k:
        new.append((first + full, 1, room - k * length))
        pieces.append(np.array([first + full]))
        reps.append(np.array([k]))
    return new, full + (k > 0)


def _ffd(lens: np.ndarray, cap: int):
    """First fit over runs of consecutive bins that share their remaining room ("blocks")."""
    order, distinct, counts = _decreasing(lens, cap)
    start = np.zeros(0, dtype=np.int64)
    count = np.zeros(0, dtype=np.int64)
    level = np.zeros(0, dtype=np.int64)
    pieces, reps, nbins = [], [], 0
    floor = distinct[-1]  # blocks with less room than the shortest item are dead: pruned
    for length, c in zip(distinct, counts):
        if level.size and level.min() < floor:
            alive = level >= floor
            start, count, level = start[alive], count[alive], level[alive]
        cand = np.flatnonzero(level >= length)
        if cand.size:
            q = level[cand] // length
            cnt_c = count[cand]
            cs = np.cumsum(cnt_c * q)
            nfull = int(np.searchsorted(cs, c, side="right"))
            if nfull:
                blocks = cand[:nfull]
                cnt = cnt_c[:nfull]
                first = np.repeat(start[blocks] - (np.cumsum(cnt) - cnt), cnt)
                pieces.append(first + np.arange(first.size))
                reps.append(np.repeat(q[:nfull], cnt))
                level[blocks] -= q[:nfull] * length
                c -= int(cs[nfull - 1])
            if c and nfull < cand.size:  # split that block: full bins, one partial, the rest
                p = int(cand[nfull])
                s0, n0, l0, q0 = int(start[p]), int(count[p]), int(level[p]), int(q[nfull])
                new, used = _fill_run(s0, c, q0, l0, length, pieces, reps)
                if used < n0:
                    new.append((s0 + used, n0 - used, l0))
                add = np.array(new, dtype=np.int64).reshape(-1, 3)
                start = np.concatenate([start[:p], add[:, 0], start[p + 1:]])
                count = np.concatenate([count[:p], add[:, 1], count[p + 1:]])
                level = np.concatenate([level[:p], add[:, 2], level[p + 1:]])
                c = 0
        if c:
            new, used = _fill_run(nbins, c, cap // length, cap, length, pieces, reps)
            nbins += used
            add = np.array(new, dtype=np.int64).reshape(-1, 3)
            start = np.concatenate([start, add[:, 0]])
            count = np.concatenate([count, add[:, 1]])
            level = np.concatenate([level, add[:, 2]])
    item_bin = np.repeat(np.concatenate(pieces), np.concatenate(reps).astype(np.int64))
    return order, item_bin, nbins


def _spfhp(lens: np.ndarray, cap: int):
    order, distinct, counts = _decreasing(lens, cap)
    levels, steps, nbins = _Levels(distinct[-1]), _Steps(), 0
    for length, c in zip(distinct, counts):
        keys = levels.keys
        i = len(keys) - 1
        while c and i >= 0 and keys[i] >= length:  # sweep from the most room down
            r = keys[i]
            lst = levels.bins[r]  # order inside a level does not matter here
            k = min(c, len(lst))
            taken = lst[len(lst) - k:]
            del lst[len(lst) - k:]
            c -= k
            steps.add(taken, 1)
            if not lst:
                levels.drop(r)
            levels.add(r - length, taken)
            i = bisect_left(keys, r) - 1
        if c:  # one new pack per remaining sequence
            ids = list(range(nbins, nbins + c))
            steps.add(ids, 1)
            levels.add(cap - length, ids)
            nbins += c
    return order, steps.item_bins(), nbins


_PACKERS = {"bfd": _bfd, "ffd": _ffd, "spfhp": _spfhp}
