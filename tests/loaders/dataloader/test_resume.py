"""loaders.dataloader.resume: a state taken after ``iter()`` and before the first batch names its rank and shape,
and in a list of rank states means "this rank has delivered nothing of this epoch yet"."""
import collections

import pytest

from datapipe import ShardStream
from datapipe.order import elastic
from loaders import DataLoader
from tests.shards import write_shards


def keys(batch):
    return [s["__key__"] for s in batch]


def _loader(urls, rank, world, workers):
    stream = ShardStream(urls, shuffle=True, seed=4, shuffle_buffer=3, rank=rank, world_size=world)
    return DataLoader(stream, batch_size=3, num_workers=workers, collate_fn=keys)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    urls, samples = write_shards(str(tmp_path_factory.mktemp("zero_batches")), [7, 0, 11, 5, 9])  # 32 samples
    return urls, sorted(s["__key__"] for s in samples)


def _states(urls, workers, taken):
    """Per rank of 2: its state after ``iter()`` and ``taken[r]`` batches, and the keys it handed out."""
    states, before = [], []
    for r, k in enumerate(taken):
        loader = _loader(urls, r, 2, workers)
        it = iter(loader)
        for _ in range(k):
            before += next(it)
        states.append(loader.state_dict())
        it.close()
    return states, before


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_before_the_first_batch_names_its_rank_and_shape(data, workers):
    urls, _ = data
    (state,), _ = _states(urls, workers, [0])
    assert state["batches"] == 0
    ds = state["dataset"]
    assert (ds["kind"], ds["rank"], ds["world_size"], ds["workers"]) == ("ShardStream", 0, 2, {})
    assert elastic.shape(state) == {"world_size": 2, "num_workers": max(1, workers)}


@pytest.mark.parametrize("taken", [(0, 0), (0, 2), (3, 0)])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_a_list_with_states_before_the_first_batch_resumes_the_epoch_on_any_shape(data, workers, taken, new_world):
    urls, everything = data
    states, before = _states(urls, workers, taken)
    after, batches = [], []
    for r in range(new_world):
        loader = _loader(urls, r, new_world, 2 if workers == 0 else 0)  # another shape, also on 2 ranks
        loader.load_state_dict(states)
        got = [k for b in loader for k in b]
        after += got
        batches.append(len(got))
    seen = collections.Counter(before + after)
    assert set(seen) == set(everything)  # every sample of the epoch, the delivered ones not again but for padding
    assert sum(n - 1 for n in seen.values()) <= (2 - 1) + (new_world - 1)
    assert len(set(batches)) == 1  # equal per rank: DDP does not hang
    if taken == (0, 0):  # nothing handed out: every rank starts the epoch, each sample once over the ranks
        assert set(after) == set(everything)


@pytest.mark.parametrize("workers", [0, 2])
def test_same_shape_list_before_the_first_batch_is_each_ranks_whole_epoch(data, workers):
    urls, _ = data
    states, _ = _states(urls, workers, [0, 2])
    for r in range(2):
        full = [k for b in _loader(urls, r, 2, workers) for k in b]
        loader = _loader(urls, r, 2, workers)
        loader.load_state_dict(states)
        got = [k for b in loader for k in b]
        assert got == (full if r == 0 else full[6:])  # bit-exact: rank 0 from its start, rank 1 after 2 batches
