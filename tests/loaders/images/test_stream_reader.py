"""The stream reader's read workers: each worker's partial last batch (its tail) joins the others' into full
batches, so ``read_workers`` changes neither the batch count nor which samples a train epoch drops."""
import pytest
import torch

pytest.importorskip("nvidia.dali")

from datapipe.stream import ShardStream  # noqa: E402
from datapipe.tools.synthetic import make_image_dataset  # noqa: E402
from loaders.images.loader import ImageLoader  # noqa: E402
from loaders.images.options import DecodeOptions, ReadOptions  # noqa: E402

N = 43  # shards of 10, 10, 10, 10, 3: 2 workers read 21 and 22 samples, 3 workers 14, 14 and 15
S = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("tails")
    info = make_image_dataset(str(out), num_images=N, num_classes=10, seed=3, shard_max_count=10,
                              size=(40, 32), progress=False)
    return info["shards"]


def make(shards, *, workers, batch_size, train, seed=0, drop_last=None):
    stream = ShardStream(shards, shuffle=train, shuffle_buffer=16 if train else 0, seed=seed)
    read = ReadOptions(reader="stream", read_workers=workers, label_key="__key__", label_decoder=int,
                       drop_last=drop_last)
    return ImageLoader(stream, batch_size=batch_size, image_size=S, train=train, device="cpu", read=read,
                       decode=DecodeOptions(num_threads=1))


def run(it):
    return [(x, y) for x, y in it]


def labels(batches):
    return [y.tolist() for _, y in batches]


@pytest.mark.parametrize("workers,batch_size", [(2, 8), (3, 8), (3, 4), (2, 11)])
def test_train_drops_only_the_epochs_last_partial_batch(shards, workers, batch_size):
    dl = make(shards, workers=workers, batch_size=batch_size, train=True)
    got = labels(run(dl))
    assert len(got) == len(dl) == N // batch_size
    assert all(len(b) == batch_size for b in got)
    keys = [k for b in got for k in b]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("workers,batch_size", [(2, 8), (3, 8), (3, 4), (2, 11)])
def test_eval_gives_every_sample_once_and_only_the_last_batch_smaller(shards, workers, batch_size):
    dl = make(shards, workers=workers, batch_size=batch_size, train=False)
    got = labels(run(dl))
    assert len(got) == len(dl) == -(-N // batch_size)
    assert [len(b) for b in got[:-1]] == [batch_size] * (len(got) - 1)
    assert sorted(k for b in got for k in b) == list(range(N))


@pytest.mark.parametrize("workers", [2, 3])
def test_the_same_seed_gives_the_same_batches(shards, workers):
    a = run(make(shards, workers=workers, batch_size=8, train=True, seed=4))
    b = run(make(shards, workers=workers, batch_size=8, train=True, seed=4))
    assert labels(a) == labels(b)
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))


# (workers, batch_size, train, k): resume after k batches, in the tails (2 x 8: batches 5 and 6 are made of
# tails; 3 x 4: 9 full, then tails) and, with 2 x 11 (worker 0: 1 batch and a tail of 10, worker 1: 2
# batches), while worker 0's tail waits for worker 1's last full batch
@pytest.mark.parametrize("workers,batch_size,train,k", [(2, 8, True, 4), (2, 8, False, 5), (3, 4, True, 9),
                                                        (3, 4, True, 10), (3, 4, False, 10), (2, 11, False, 2),
                                                        (2, 11, False, 3)])
def test_resume_at_a_tail_yields_exactly_the_rest(shards, workers, batch_size, train, k):
    full = make(shards, workers=workers, batch_size=batch_size, train=train)
    full.set_epoch(1)
    whole = run(full)
    first = make(shards, workers=workers, batch_size=batch_size, train=train)
    first.set_epoch(1)
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    it.close()
    rest = make(shards, workers=workers, batch_size=batch_size, train=train)
    rest.load_state_dict(state)
    resumed = head + run(rest)
    assert labels(resumed) == labels(whole)
    if not train:  # (a resumed stream reader's DALI pipeline draws its random crops anew)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(resumed, whole))


@pytest.mark.parametrize("epoch", [0, 1])
def test_the_pass_after_a_resumed_one_is_a_whole_epoch(shards, epoch):
    """The read workers took the resume: the main process's stream forgets it, so the next pass is whole."""
    full = make(shards, workers=2, batch_size=5, train=False)
    full.set_epoch(epoch)
    run(full)
    second = labels(run(full))
    first = make(shards, workers=2, batch_size=5, train=False)
    first.set_epoch(epoch)
    it = iter(first)
    next(it)
    state = first.state_dict()
    it.close()
    rest = make(shards, workers=2, batch_size=5, train=False)
    rest.load_state_dict(state)
    run(rest)
    assert labels(run(rest)) == second
