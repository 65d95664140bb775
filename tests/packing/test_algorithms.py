import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packing import pack_lengths
from packing.algorithms import ALGORITHMS


def naive_decreasing(lengths, capacity, choose):
    """One item at a time, longest first (ties by index); ``choose`` picks a bin or None."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room, bins = [], []
    for i in order:
        b = choose(room, lengths[i])
        if b is None:
            room.append(capacity)
            bins.append([])
            b = len(room) - 1
        room[b] -= lengths[i]
        bins[b].append(i)
    return bins


def best_fit(room, n):
    fits = [(r, b) for b, r in enumerate(room) if r >= n]
    return min(fits)[1] if fits else None


def first_fit(room, n):
    return next((b for b, r in enumerate(room) if r >= n), None)


def check_bins(bins, lengths, capacity):
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= capacity


cases = st.integers(1, 64).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=80)))


@settings(max_examples=150, deadline=None)
@given(cases)
def test_bfd_and_ffd_match_one_item_at_a_time_reference(case):
    capacity, lengths = case
    assert pack_lengths(lengths, capacity, algorithm="bfd") == naive_decreasing(lengths, capacity, best_fit)
    assert pack_lengths(lengths, capacity, algorithm="ffd") == naive_decreasing(lengths, capacity, first_fit)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(0, cap), max_size=200))),
       st.sampled_from(ALGORITHMS))
def test_every_index_once_and_capacity_kept(case, algorithm):
    capacity, lengths = case
    bins = pack_lengths(np.array(lengths, dtype=np.int32), capacity, algorithm=algorithm)
    check_bins(bins, lengths, capacity)
    assert all(bins)  # no empty bin


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_large_skewed_input(algorithm):
    rng = np.random.default_rng(0)
    capacity = 4096
    lengths = np.clip(rng.lognormal(6.5, 1.0, 200_000).astype(np.int64), 1, capacity)
    bins = pack_lengths(lengths, capacity, algorithm=algorithm)
    flat = np.concatenate([np.asarray(b) for b in bins])
    assert np.array_equal(np.sort(flat), np.arange(lengths.size))
    owner = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    fills = np.bincount(owner, weights=lengths[flat])
    assert fills.max() <= capacity
    assert lengths.sum() / (len(bins) * capacity) > 0.99


@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
def test_complementary_pairs_fill_bins_exactly(algorithm):
    capacity = 1000
    small = list(range(1, 400))
    lengths = small + [capacity - n for n in small][::-1]
    bins = pack_lengths(lengths, capacity, algorithm=algorithm)
    assert len(bins) == len(small)
    assert all(sum(lengths[i] for i in b) == capacity for b in bins)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 50).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(0, 4 * cap), max_size=60))),
       st.sampled_from(ALGORITHMS))
def test_chunk_split_tiles_every_item(case, algorithm):
    capacity, lengths = case
    bins = pack_lengths(lengths, capacity, algorithm=algorithm, split="chunk")
    pieces = {}
    for b in bins:
        assert sum(e - s for _, s, e in b) <= capacity
        for i, s, e in b:
            pieces.setdefault(i, []).append((s, e))
    assert sorted(pieces) == list(range(len(lengths)))
    for i, ps in pieces.items():
        ps.sort()
        assert ps[0][0] == 0 and ps[-1][1] == lengths[i]
        assert all(a[1] == b[0] for a, b in zip(ps, ps[1:]))
        assert all(0 <= e - s <= capacity for s, e in ps)
        assert len(ps) == max(1, -(-lengths[i] // capacity))


def test_zero_length_items_go_to_first_bin():
    assert pack_lengths([0, 3, 0], 4) == [[1, 0, 2]]
    assert pack_lengths([0, 0], 4) == [[0, 1]]
    assert pack_lengths([], 4) == []


def test_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="split='chunk'"):
        pack_lengths([1, 9, 2], 8)
    with pytest.raises(ValueError, match=">= 0"):
        pack_lengths([1, -1], 8)
    for cap in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="capacity"):
            pack_lengths([1], cap)
    with pytest.raises(ValueError, match="unknown algorithm"):
        pack_lengths([1], 8, algorithm="nfd")
    with pytest.raises(ValueError, match="unknown split"):
        pack_lengths([1], 8, split="yes")
    with pytest.raises(ValueError, match="1-D"):
        pack_lengths([[1, 2]], 8)
    with pytest.raises(ValueError, match="integers"):
        pack_lengths([1.5], 8)
