"""A checkpoint records what it was taken over and loads only there; every state a rank can produce loads."""
import collections
import os

import pytest
import torch

import loaders
from datapipe import ShardStream, mix
from datapipe.order import elastic
from tests.datapipe.order.test_elastic import run_rank
from tests.shards import write_shards


def _state_after(stream, k):
    it = iter(stream)
    for _ in range(k):
        next(it)
    return stream.state_dict()


@pytest.mark.parametrize("change", [{"seed": 1}, {"shuffle_buffer": 8}, {"shuffle": False}])
def test_other_settings_are_refused_by_name_with_both_values(tmp_path, change):
    urls, _ = write_shards(str(tmp_path), [30, 40, 30])
    make = dict(shuffle=True, seed=0, shuffle_buffer=4)
    state = _state_after(ShardStream(urls, **make), 10)
    other = ShardStream(urls, **{**make, **change})
    (name, value), = change.items()
    with pytest.raises(ValueError, match=f"{name}={make[name]!r}.*{name}={value!r}"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=name):  # the global (list) form too
        other.load_state_dict([state])
    ShardStream(urls, **make).load_state_dict(state)  # the same settings load


def test_other_shards_with_the_same_total_are_refused(tmp_path):
    a, _ = write_shards(str(tmp_path / "a"), [40, 41])
    b, _ = write_shards(str(tmp_path / "b"), [41, 40])  # 81 samples too
    state = _state_after(ShardStream(a, shuffle=True), 5)
    with pytest.raises(ValueError, match="shards=.*2 shards, 81 samples"):
        ShardStream(b, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="shards="):
        ShardStream(a[:1] + b[:1], shuffle=True).load_state_dict(state)


def test_a_mix_state_records_its_weights(tmp_path):
    a, _ = write_shards(str(tmp_path / "a"), [10], prefix="a")
    b, _ = write_shards(str(tmp_path / "b"), [12], prefix="b")
    m = mix([ShardStream(a), ShardStream(b)], weights=[0.5, 0.5])
    state = _state_after(m, 4)
    with pytest.raises(ValueError, match=r"weights=\[0.5, 0.5\].*weights=\[0.9, 0.1\]"):
        mix([ShardStream(a), ShardStream(b)], weights=[0.9, 0.1]).load_state_dict(state)
    with pytest.raises(ValueError, match="shards="):  # its streams' states are checked too
        again = mix([ShardStream(b), ShardStream(a)], weights=[0.5, 0.5])
        again.load_state_dict(state)
        list(again)


@pytest.mark.parametrize("bad, message", [
    ("a string", "expected the dict"),
    ({"kind": "ShardStream", "num_workers": 0, "workers": {}}, "'epoch'"),
    ({"kind": "ShardStream", "epoch": "1", "num_workers": 0, "workers": {}}, "'epoch' entry is str"),
    ({"kind": "ShardStream", "epoch": 1, "num_workers": 0, "workers": "w"}, "'workers' entry is str"),
    ({"kind": "Mix", "epoch": 1, "num_workers": 0, "workers": {}}, "this is a Mix state"),
    ({"kind": "ShardStream", "epoch": 1, "num_workers": 1, "workers": {0: "x"}}, "worker 0's position is 'x'"),
    ({"kind": "ShardStream", "epoch": 1, "num_workers": 1, "workers": {0: {"draws": "3"}}}, "worker 0's position"),
])
def test_malformed_states_are_value_errors_naming_what_is_wrong(tmp_path, bad, message):
    urls, _ = write_shards(str(tmp_path), [5])
    with pytest.raises(ValueError, match=message):
        ShardStream(urls).load_state_dict(bad)


def test_malformed_mix_state(tmp_path):
    urls, _ = write_shards(str(tmp_path), [5])
    with pytest.raises(ValueError, match="'workers' entry is list"):
        mix([ShardStream(urls)], weights=[1]).load_state_dict({"kind": "Mix", "epoch": 0, "num_workers": 0,
                                                               "workers": []})


@pytest.mark.parametrize("new_world", [2, 3])
def test_rank_states_taken_after_an_epoch_ended_load(tmp_path, new_world):
    urls, _ = write_shards(str(tmp_path), [5, 6, 7])
    states = []
    for r in range(2):
        dl = loaders.DataLoader(ShardStream(urls, rank=r, world_size=2), batch_size=2, num_workers=1)
        list(dl)
        states.append(dl.state_dict())
    assert states[0]["epoch"] == 1 and states[0]["batches"] == 0 and states[0]["dataset"] is None
    keys = []
    for r in range(new_world):
        dl = loaders.DataLoader(ShardStream(urls, rank=r, world_size=new_world), batch_size=None, num_workers=1)
        dl.load_state_dict(states)
        assert dl.state_dict()["epoch"] == 1
        keys += [s["__key__"] for s in dl]
    assert len(set(keys)) == 18 and len(keys) == 18 + (-18 % new_world)  # the whole of epoch 1


def test_rank_states_that_disagree_are_refused(tmp_path):
    urls, _ = write_shards(str(tmp_path), [6])
    done = loaders.DataLoader(ShardStream(urls, rank=0, world_size=2), batch_size=1)
    list(done)
    mid = loaders.DataLoader(ShardStream(urls, rank=1, world_size=2), batch_size=1)
    next(iter(mid))
    with pytest.raises(ValueError, match="disagree"):
        elastic.merge_states([done.state_dict(), mid.state_dict()])


def test_mix_second_reshape_with_a_source_no_worker_read_is_exact(tmp_path):
    """2x1 -> 3x1 -> 1x2 with weights 0.9 / 0.1: the light source, read before the first reshape and by
    no worker after it, keeps its new plan: nothing repeats, nothing is lost."""
    a, _ = write_shards(str(tmp_path / "a"), [10, 10, 10], prefix="a")
    b, _ = write_shards(str(tmp_path / "b"), [4], prefix="b")

    def make(rank, world):
        return mix([ShardStream(a, rank=rank, world_size=world), ShardStream(b, rank=rank, world_size=world)],
                   weights=[0.9, 0.1], seed=0, stop="all")

    for k1 in (6, 8, 10, 12):
        seen, states = [], []
        for r in range(2):
            got, st = run_rank(make(r, 2), 1, k1)
            seen += got
            states.append(st)
        states2 = []
        for r in range(3):
            got, st = run_rank(make(r, 3), 1, 1, state=elastic.merge_states(states))
            seen += got
            states2.append(st)
        seen += run_rank(make(0, 1), 2, state=elastic.merge_states(states2))[0]
        counts = collections.Counter(seen)
        assert len(counts) == 34 and sum(counts.values()) == 34, (k1, [k for k, n in counts.items() if n > 1])


def test_a_state_taken_right_after_a_load_keeps_the_loaded_position(tmp_path):
    urls, _ = write_shards(str(tmp_path), [9, 8])
    full = [s["__key__"] for s in ShardStream(urls, shuffle=True, shuffle_buffer=3)]
    first = ShardStream(urls, shuffle=True, shuffle_buffer=3)
    state = _state_after(first, 5)
    loaded = ShardStream(urls, shuffle=True, shuffle_buffer=3)
    loaded.load_state_dict(state)
    again = ShardStream(urls, shuffle=True, shuffle_buffer=3)
    again.load_state_dict(loaded.state_dict())  # nothing read since the load: the same position
    assert [s["__key__"] for s in again] == full[5:]


def test_a_shuffled_state_from_before_the_shard_order_was_recorded_is_refused(tmp_path):
    """The shuffled shard order changed (splitmix64 keys, not numpy.random): a checkpoint that does not name its
    order was taken under the old one and would resume into other shards, so it is refused, not loaded."""
    urls, _ = write_shards(str(tmp_path), [30, 40, 30])
    state = _state_after(ShardStream(urls, shuffle=True, seed=0), 10)
    assert state["shard_order"]
    old = {k: v for k, v in state.items() if k != "shard_order"}
    with pytest.raises(ValueError, match="earlier datapipe.*shard order"):
        ShardStream(urls, shuffle=True, seed=0).load_state_dict(old)
    with pytest.raises(ValueError, match="shard_order='older'"):
        ShardStream(urls, shuffle=True, seed=0).load_state_dict({**state, "shard_order": "older"})
    unshuffled = {k: v for k, v in _state_after(ShardStream(urls), 10).items() if k != "shard_order"}
    ShardStream(urls).load_state_dict(unshuffled)  # input order never changed: such a state still loads
