"""ImageLoader's epochs: each pass that runs to its end is the next epoch, reshuffled, whatever the reader (#44)."""
import pytest
import torch
import webdataset

pytest.importorskip("nvidia.dali")

from datapipe.stream import ShardStream  # noqa: E402
from datapipe.tools.synthetic import iter_image_samples  # noqa: E402
from loaders.dataloader.state import LoaderState  # noqa: E402
from loaders.images.epochs import EpochClock  # noqa: E402
from loaders.images.loader import ImageLoader  # noqa: E402
from loaders.images.options import DecodeOptions, ReadOptions  # noqa: E402

N, SHARDS = 40, 4  # 10 samples a shard; batches of 6: 36 a pass under drop_last, 4 left out


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """Shards whose 'cls' label is the sample's own number: 0-9 in the first shard, 10-19 in the second..."""
    out = tmp_path_factory.mktemp("epochs")
    urls = []
    for shard in range(SHARDS):
        url = str(out / f"n-{shard}.tar")
        with webdataset.TarWriter(url) as w:
            for s in iter_image_samples(N // SHARDS, seed=shard, num_classes=10, size=(40, 32), start=shard * 10):
                w.write({**s, "cls": str(int(s["__key__"])).encode()})
        urls.append(url)
    return urls


READERS = {  # the stream reader as each of its users reaches it, and DALI's
    "stream": dict(reader="stream"),
    "skip": dict(on_error="skip"),  # reader="auto" takes the stream reader
    "workers": dict(read_workers=1),
    "dali": dict(reader="dali"),
}


def make(urls, how="stream", *, stream=None, train=True, **read):
    kw = dict(READERS[how])
    on_error = kw.pop("on_error", "raise")
    source = stream if stream is not None else ShardStream(urls, shuffle=True, shuffle_buffer=8, seed=1,
                                                           on_error=on_error)
    return ImageLoader(source, batch_size=6, image_size=16, device="cpu", train=train,
                       decode=DecodeOptions(num_threads=1),
                       read=ReadOptions(index_dir=str(urls[0]) + ".ix", **kw, **read))


def labels(dl):
    return [y for _, ys in dl for y in ys.tolist()]


def passes(dl, n):
    return [labels(dl) for _ in range(n)]


@pytest.mark.parametrize("how", list(READERS))
def test_each_pass_is_the_next_epoch_reshuffled(numbered, how):
    dl = make(numbered, how)
    orders = passes(dl, 3)
    assert dl.epoch == 3
    assert all(len(o) == N // 6 * 6 and len(set(o)) == len(o) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # the trial's bug: one order every pass
    assert len(set().union(*orders)) > N // 6 * 6  # the samples drop_last leaves out differ: all get trained on


@pytest.mark.parametrize("how", ["stream", "workers"])
def test_a_pass_is_the_epoch_set_epoch_would_choose(numbered, how):
    auto = passes(make(numbered, how), 3)
    chosen = []
    for e in range(3):
        dl = make(numbered, how)
        dl.set_epoch(e)
        chosen.append(labels(dl))
    assert auto == chosen


def test_set_epoch_still_chooses_and_the_count_goes_on_from_it(numbered):
    dl = make(numbered)
    first, _ = passes(dl, 2)
    dl.set_epoch(0)
    assert labels(dl) == first and dl.epoch == 1


def test_a_pass_stopped_early_does_not_move_the_epoch_on(numbered):
    dl = make(numbered)
    whole = make(numbered)
    it = iter(dl)
    next(it)
    it.close()
    assert dl.epoch == 0
    assert labels(dl) == labels(whole)  # epoch 0 again, from its start


def test_the_streams_epoch_set_by_someone_else_is_followed(numbered):
    dl, seven = make(numbered), make(numbered)
    labels(dl)
    dl.stream.set_epoch(7)
    seven.set_epoch(7)
    assert labels(dl) == labels(seven) and dl.epoch == 8


# the stream reader's augmentations are not in its state (DALI's are, with DALI's reader): exact images
# need train=False there (the stream still shuffles: its settings hold)
@pytest.mark.parametrize("how", ["stream", "workers", "dali"])
def test_a_state_taken_between_passes_resumes_the_next_epoch_exactly(numbered, how):
    train = how == "dali"
    dl = make(numbered, how, train=train)
    labels(dl)
    state = dl.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 0
    again = make(numbered, how, train=train)
    again.load_state_dict(state)
    a, b = list(dl), list(again)
    assert len(a) == len(b) == len(dl)
    assert all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))  # images too
    assert again.epoch == dl.epoch == 2


@pytest.mark.parametrize("how", ["stream", "dali"])
def test_resume_across_the_epoch_boundary_is_exact(numbered, how):
    from tests.resume import assert_resumes_identically

    def two_epochs(dl):
        for _ in range(3):  # a resumed loader: the rest of its epoch, then the next
            if dl.epoch >= 2:
                return
            yield from dl

    train = how == "dali"
    per_epoch = N // 6 if train else -(-N // 6)
    full = assert_resumes_identically(lambda: make(numbered, how, train=train),
                                      steps=[0, 2, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch - 1],
                                      iterate=two_epochs,
                                      same=lambda a, b: torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    assert len(full) == 2 * per_epoch
    first = [y for _, ys in full[:per_epoch] for y in ys.tolist()]
    assert first != [y for _, ys in full[per_epoch:] for y in ys.tolist()]  # reshuffled


def test_a_shuffled_stream_without_a_buffer_shuffles_with_dalis_reader(numbered):
    """The trial's second bug: DALI's reader got a shuffle window of 1, so every epoch came out in file order."""
    stream = ShardStream(numbered, shuffle=True, seed=4)
    dl = make(numbered, "dali", stream=stream, drop_last=False)
    orders = passes(dl, 3)
    assert all(sorted(o) == list(range(N)) for o in orders)
    assert all(o != list(range(N)) for o in orders) and len({tuple(o) for o in orders}) == 3


def test_a_shuffled_stream_without_a_buffer_shuffles_its_shard_order_each_epoch_with_the_stream_reader(numbered):
    stream = ShardStream(numbered, shuffle=True, seed=4)
    dl = make(numbered, "stream", stream=stream, drop_last=False)
    orders = passes(dl, 4)
    shard_orders = {tuple(o[i] // 10 for i in range(0, N, 10)) for o in orders}
    assert all(sorted(o) == list(range(N)) for o in orders)
    assert all(o[i:i + 10] == sorted(o[i:i + 10]) for o in orders for i in range(0, N, 10))  # shards read whole
    assert len(shard_orders) > 1


def test_imageloader_runs_loaders_dataloaders_epoch_rule():
    assert EpochClock._sync_dataset_epoch is LoaderState._sync_dataset_epoch
    assert EpochClock._set_epoch is LoaderState.set_epoch
