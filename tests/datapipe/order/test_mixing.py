import collections
import itertools

import pytest
import torch

from datapipe import ShardStream, mix
from tests.shards import write_shards
from tests.resume import assert_resumes_identically


class Recorder:
    """A list-backed stream with set_epoch (recorded) and state, like a ShardStream."""

    def __init__(self, items):
        self.items = list(items)
        self.epochs = []
        self.epoch = 0
        self._pos = {"taken": 0}
        self._resume = None

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.epochs.append(epoch)

    def __iter__(self):
        start, self._resume = (self._resume or 0), None
        self._pos = {"taken": start}
        for item in self.items[start:]:
            self._pos["taken"] += 1
            yield (item, self.epoch)

    def state_dict(self):
        return dict(self._pos)

    def load_state_dict(self, state):
        self._resume = state["taken"]


def test_stop_first_all_restart():
    a, b = list(range(10)), list(range(100, 104))
    first = list(mix([a, b], weights=[1, 1], stop="first"))
    assert set(b) <= set(first) or set(a) <= set(first)
    assert len(first) == len(set(first)) < 14
    done = list(mix([a, b], weights=[1, 1], stop="all"))
    assert sorted(done) == a + b
    assert [x for x in done if x < 100] == a and [x for x in done if x >= 100] == b
    again = list(mix([a, b], weights=[1, 1], stop="restart"))
    counts = collections.Counter(again)
    assert set(a) <= set(counts) and set(b) <= set(counts)
    assert max(counts[x] for x in b) >= 2  # the short stream was restarted while the long one ran
    assert all(counts[x] == 1 for x in a[:-1]) and counts[a[-1]] == 1


def test_restart_calls_set_epoch_on_the_exhausted_stream():
    short, long = Recorder("xy"), Recorder(range(20))
    m = mix([short, long], weights=[1, 1], stop="restart", seed=3)
    m.set_epoch(5)
    got = list(m)
    assert short.epochs[0] == 5 and long.epochs == [5]
    assert short.epochs[1:] == list(range(6, 6 + len(short.epochs) - 1)) and len(short.epochs) >= 3
    assert [i for i, e in got if isinstance(i, int)] == list(range(20))
    assert set(short.epochs[:-1]) <= {e for i, e in got if isinstance(i, str)} <= set(short.epochs)


def test_deterministic_and_seed_and_epoch_dependent():
    a, b, c = list(range(50)), list(range(100, 150)), list(range(200, 250))
    one = list(mix([a, b, c], weights=[1, 2, 3], seed=1))
    assert one == list(mix([a, b, c], weights=[1, 2, 3], seed=1))
    assert one != list(mix([a, b, c], weights=[1, 2, 3], seed=2))
    m = mix([a, b, c], weights=[1, 2, 3], seed=1)
    m.set_epoch(1)
    assert list(m) != one


def test_proportions_match_weights():
    """Chi-square over 6000 seeded draws: below 27.6 (p = 1e-6 for 2 degrees of freedom)."""
    weights = [0.6, 0.3, 0.1]
    streams = [[i] * 10000 for i in range(3)]
    n = 6000
    for seed in range(3):
        got = collections.Counter(itertools.islice(mix(streams, weights=weights, seed=seed), n))
        chi2 = sum((got[i] - n * w) ** 2 / (n * w) for i, w in enumerate(weights))
        assert chi2 < 27.6, (seed, got)


def test_renormalised_after_a_stream_runs_out():
    a, b, c = [0] * 100, [1] * 3000, [2] * 3000
    got = list(mix([a, b, c], weights=[0.8, 0.1, 0.1], seed=0, stop="all"))
    first_after = max(i for i, x in enumerate(got) if x == 0) + 1
    tail = collections.Counter(got[first_after:first_after + 2000])
    chi2 = sum((tail[i] - 1000) ** 2 / 1000 for i in (1, 2))
    assert chi2 < 24  # p = 1e-6 for 1 degree of freedom: 1 and 2 now share evenly


def test_zero_weight_stream_is_never_drawn():
    got = list(mix([[1] * 5, [2] * 5], weights=[1, 0], stop="restart"))
    assert got == [1] * 5


@pytest.mark.parametrize("stop", ["first", "all", "restart"])
def test_resume_exact_with_shard_streams(tmp_path, stop):
    u1, _ = write_shards(tmp_path / "a", [4, 3], prefix="a")
    u2, _ = write_shards(tmp_path / "b", [5], prefix="b")

    def make():
        m = mix([ShardStream(u1, shuffle=True, shuffle_buffer=3, seed=1), ShardStream(u2, shuffle=True, seed=2)],
                weights=[2, 1], seed=4, stop=stop)
        m.set_epoch(2)
        return m

    full = assert_resumes_identically(make)
    keys = [s["__key__"] for s in full]
    if stop == "all":
        assert len(keys) == len(set(keys)) == 12
    if stop == "restart":
        assert len(keys) > 12 and len(set(keys)) == 12


@pytest.mark.parametrize("stop", ["all", "restart"])
def test_resume_exact_with_plain_lists_and_stateful_streams(stop):
    def make():
        return mix([list(range(7)), Recorder("abcd")], weights=[1, 1], seed=9, stop=stop)

    assert_resumes_identically(make)


def test_in_dataloader_workers_every_sample_once(tmp_path):
    u1, s1 = write_shards(tmp_path / "a", [6, 5], prefix="a")
    u2, s2 = write_shards(tmp_path / "b", [7], prefix="b")
    m = mix([ShardStream(u1), ShardStream(u2)], weights=[1, 1], stop="all")
    got = [s["__key__"] for s in torch.utils.data.DataLoader(m, batch_size=None, num_workers=2)]
    assert sorted(got) == sorted(s["__key__"] for s in s1 + s2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="^got 1 weight for 2 streams: give one weight per stream$"):
        mix([[1], [2]], weights=[1])
    with pytest.raises(ValueError, match="weights"):
        mix([[1], [2]], weights=[1, -1])
    with pytest.raises(ValueError, match="weights"):
        mix([[1], [2]], weights=[0, 0])
    with pytest.raises(ValueError, match="stop"):
        mix([[1]], weights=[1], stop="longest")
    with pytest.raises(ValueError, match="iterator"):
        mix([iter([1])], weights=[1])
    m = mix([[1]], weights=[1])
    with pytest.raises(ValueError, match="not a Mix state"):
        m.load_state_dict({"epoch": 0})


def test_what_an_epoch_holds_is_stated_and_stop_all_holds_everything_on_any_worker_count(tmp_path):
    u1, s1 = write_shards(tmp_path / "a", [20, 20, 20, 20], prefix="a")
    u2, s2 = write_shards(tmp_path / "b", [9, 9, 9, 9], prefix="b")

    def keys(stop, workers):
        m = mix([ShardStream(u1), ShardStream(u2)], weights=[1, 1], seed=3, stop=stop)
        return [s["__key__"] for s in torch.utils.data.DataLoader(m, batch_size=None, num_workers=workers)]

    assert sorted(keys("all", 0)) == sorted(keys("all", 2)) == sorted(s["__key__"] for s in s1 + s2)
    # "first" ends where each worker's own share of a stream runs out: stats() says the length varies with workers
    first = mix([ShardStream(u1), ShardStream(u2)], weights=[1, 1], seed=3, stop="first")
    st = first.stats()
    assert st["stop"] == "first" and "num_workers" in st["epoch_holds"] and "world size" in st["epoch_holds"]
    assert "neither num_workers nor world size" in mix([[1]], weights=[1], stop="all").stats()["epoch_holds"]
    lengths = {len(keys("first", 0)), len(keys("first", 1)), len(keys("first", 2))}
    assert all(0 < n < 116 for n in lengths)  # never both streams whole


def _mix_loader(urls_a, urls_b, workers, stop, persistent=False):
    """A mix of two shuffled ShardStreams (keys only) in loaders.DataLoader."""
    import loaders

    a = ShardStream(urls_a, shuffle=True, shuffle_buffer=8, seed=0).map(_key)
    b = ShardStream(urls_b, shuffle=True, shuffle_buffer=8, seed=1).map(_key)
    return loaders.DataLoader(mix([a, b], weights=[0.7, 0.3], seed=0, stop=stop), batch_size=4,
                              num_workers=workers, persistent_workers=persistent)


def _key(sample):
    return sample["__key__"]


@pytest.mark.parametrize("stop", ["restart", "first", "all"])
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_resumes_exactly_in_dataloader_workers(tmp_path, workers, stop):
    """Resumed after any batch (under "restart": before and after the short stream restarted in each worker, and
    with the next batch's worker not worker 0): the rest is the uninterrupted rest."""
    ua, _ = write_shards(tmp_path / "a", [13, 11, 9, 7], prefix="a")
    ub, _ = write_shards(tmp_path / "b", [6, 5], prefix="b")
    full = [k for batch in _mix_loader(ua, ub, workers, stop) for k in batch]
    if stop == "restart":  # b ran out and restarted in every worker while a went on
        b_counts = collections.Counter(k for k in full if k[0] == "b")
        assert len(full) > 51 and len(b_counts) == 11 and max(b_counts.values()) >= 2
    bad = []
    for k in range(1, len(full) // 4):
        loader = _mix_loader(ua, ub, workers, stop)
        it = iter(loader)
        head = [key for _ in range(k) for key in next(it)]
        state = loader.state_dict()
        resumed = _mix_loader(ua, ub, workers, stop)
        resumed.load_state_dict(state)
        if head + [key for batch in resumed for key in batch] != full:
            bad.append(k)
    assert bad == []


@pytest.mark.parametrize("stop", ["restart", "first"])
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True), (3, True)])
def test_pass_after_a_resumed_one_is_the_uninterrupted_runs_next(tmp_path, workers, persistent, stop):
    """After a resumed pass (resumed before and after a stream restarted, with the next batch's worker not worker 0),
    the next pass over the same loader is the uninterrupted run's second pass: the resumes the mix loaded into its
    streams (a persistent worker's copies keep them) are spent with the pass that loaded them."""
    ua, _ = write_shards(tmp_path / "a", [13, 11, 9, 7], prefix="a")
    ub, _ = write_shards(tmp_path / "b", [6, 5], prefix="b")

    def keys(batches):
        return [k for batch in batches for k in batch]

    loader = _mix_loader(ua, ub, workers, stop, persistent)
    first, second = keys(loader), keys(loader)
    assert first != second
    n = len(first) // 4
    points = sorted({1, 2, n // 3, n // 2, (2 * n) // 3, n - 2, n - 1} - {0})
    if stop == "restart":  # some resume point comes after b restarted in a worker
        assert any(max(collections.Counter(k for k in first[:4 * p] if k[0] == "b").values(), default=0) >= 2
                   for p in points)
    bad = []
    for p in points:
        loader = _mix_loader(ua, ub, workers, stop, persistent)
        it = iter(loader)
        head = [key for _ in range(p) for key in next(it)]
        state = loader.state_dict()
        del it
        resumed = _mix_loader(ua, ub, workers, stop, persistent)
        resumed.load_state_dict(state)
        rest = keys(resumed)
        if head + rest != first:
            bad.append((p, "resumed pass"))
        elif keys(resumed) != second:
            bad.append((p, "next pass"))
    assert bad == []


@pytest.mark.parametrize("global_state", [False, True])
def test_a_loaded_resume_applies_only_at_its_epoch(tmp_path, global_state):
    """A mix loaded with a state of epoch 0, then set to epoch 1, runs the whole epoch 1 (as a ShardStream does);
    set back to epoch 0, it still resumes."""
    urls_a, _ = write_shards(tmp_path / "a", [4, 5], prefix="a")
    urls_b, _ = write_shards(tmp_path / "b", [6, 3], prefix="b")

    def make():
        return mix([ShardStream(urls_a, shuffle=True, seed=1), ShardStream(urls_b, shuffle=True, seed=2)],
                   weights=[1, 2], seed=7, stop="all")

    def ref(epoch):
        m = make()
        m.set_epoch(epoch)
        return [s["__key__"] for s in m]

    epoch0, epoch1 = ref(0), ref(1)
    head = make()
    it = iter(head)
    for _ in range(3):
        next(it)
    state = head.state_dict()
    if global_state:
        state = [state]
    m = make()
    m.load_state_dict(state)
    m.set_epoch(1)
    assert [s["__key__"] for s in m] == epoch1
    m = make()
    m.load_state_dict(state)
    m.set_epoch(1)
    m.set_epoch(0)
    assert [s["__key__"] for s in m] == epoch0[3:]


@pytest.mark.parametrize("num_workers", [None, 0, 2])
def test_two_iterators_made_before_either_is_read_run_their_own_epochs(tmp_path, num_workers):
    """A mix iterator made for epoch 0, another for epoch 1, then both read: epoch 0 and epoch 1, directly and in
    a loaders.DataLoader with and without workers."""
    from loaders import DataLoader

    urls_a, _ = write_shards(tmp_path / "a", [4, 5], prefix="a")
    urls_b, _ = write_shards(tmp_path / "b", [6, 3], prefix="b")

    def make():
        m = mix([ShardStream(urls_a, shuffle=True, seed=1), ShardStream(urls_b, shuffle=True, seed=2)],
                weights=[1, 2], seed=7, stop="restart")
        if num_workers is None:
            return m
        return DataLoader(m, batch_size=2, num_workers=num_workers, collate_fn=lambda b: [s["__key__"] for s in b])

    reference = make()
    epoch0 = list(reference)
    reference.set_epoch(1)
    epoch1 = list(reference)
    assert epoch0 != epoch1
    m = make()
    m.set_epoch(0)
    a = iter(m)
    m.set_epoch(1)
    b = iter(m)
    got_a, got_b = [next(a)], [next(b)]
    got_a += list(a)
    got_b += list(b)
    assert (got_a, got_b) == (epoch0, epoch1)


def test_a_stream_given_to_mix_keeps_its_loaded_resume(tmp_path):
    """mix() checks that its streams are not iterators without iter() (a ShardStream's iter() takes its resume)."""
    urls, _ = write_shards(tmp_path / "a", [4, 5], prefix="a")
    stream = ShardStream(urls, shuffle=True, seed=1)
    whole = [s["__key__"] for s in stream]
    it = iter(stream)
    next(it), next(it)
    state = stream.state_dict()
    resumed = ShardStream(urls, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert [s["__key__"] for s in mix([resumed], weights=[1])] == whole[2:]
    with pytest.raises(ValueError, match="iterator"):
        mix([iter([1, 2])], weights=[1])
