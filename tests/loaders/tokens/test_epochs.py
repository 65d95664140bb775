"""TokenLoader's epochs: every pass is a fresh epoch, reshuffled (loaders.DataLoader's rule), and a state taken
between passes resumes the next epoch exactly."""
import pytest
import torch

from datapipe import ShardStream
from loaders import DataLoader, TokenLoader
from tests.loaders.tokens.test_loader import lengths, real_tokens, write_token_shards
from tests.resume import assert_resumes_identically

LENGTHS = lengths(120, seed=3, high=200)


@pytest.fixture
def urls(tmp_path):
    return write_token_shards(tmp_path, LENGTHS)  # 5 shards of 25 documents


SOURCES = {  # the loader's own stream (from URLs), and a user's: shuffled shard order and no buffer
    "urls": lambda urls: urls,
    "stream": lambda urls: ShardStream(urls, shuffle=True, seed=5),
}


def make(urls, source="urls", **kw):
    return TokenLoader(SOURCES[source](urls), seq_len=128, batch_size=4, **kw)


def ids(loader):
    """One whole pass: its batches' input_ids."""
    return [b["input_ids"] for b in loader]


def same_batches(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


EVERY_TOKEN = sorted(i * 100_000 + j for i, n in enumerate(LENGTHS) for j in range(n))


def whole_pass(loader):
    return list(loader)


def tokens_of(batches) -> list:
    """The real (non-padding) tokens of a pass, sorted."""
    return torch.cat([real_tokens(b) for b in batches]).sort().values.tolist()


@pytest.mark.parametrize("source", list(SOURCES))
def test_each_pass_is_the_next_epoch_reshuffled_and_holds_every_document_once(urls, source):
    loader = make(urls, source)
    first, second = whole_pass(loader), whole_pass(loader)
    assert loader.state_dict()["epoch"] == 2
    assert not same_batches([b["input_ids"] for b in first], [b["input_ids"] for b in second])  # the trial's bug
    assert tokens_of(first) == tokens_of(second) == EVERY_TOKEN


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_pass_is_the_epoch_set_epoch_would_choose(urls, source):
    auto = make(urls, source)
    passes = [ids(auto) for _ in range(3)]
    for epoch, expected in enumerate(passes):
        chosen = make(urls, source)
        chosen.set_epoch(epoch)
        assert same_batches(ids(chosen), expected)


def test_set_epoch_still_chooses_and_the_passes_count_on_from_it(urls):
    loader = make(urls)
    first, second = ids(loader), ids(loader)
    loader.set_epoch(0)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["batches"] == 0
    assert same_batches(ids(loader), first) and same_batches(ids(loader), second)


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_state_taken_after_a_whole_pass_resumes_the_next_epoch(urls, source):
    reference = make(urls, source)
    ids(reference)
    state = reference.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 0
    resumed = make(urls, source)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["epoch"] == 1  # loaded, not yet iterated: the loaded position
    after = ids(resumed)
    assert len(after) > 0 and same_batches(after, ids(reference))  # epoch 1, whole
    assert resumed.stats()["batches"] == len(after)
    assert same_batches(ids(resumed), ids(reference))  # and then epoch 2


@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_resume_at_every_step_of_two_epochs(tmp_path, batching):
    from tests.loaders.tokens.test_loader import tl

    urls = write_token_shards(tmp_path, lengths(50, seed=1, high=100), per_shard=10)

    def make_loader():
        return tl(urls, seq_len=100, batch_size=3, buffer_size=16, batching=batching, seed=4, shuffle_buffer=8,
                  max_tokens=400)

    def two_epochs(loader):
        for _ in range(3):  # a resumed loader: the rest of its epoch, then the next
            if loader.state_dict()["epoch"] >= 2:
                return
            yield from loader

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)

    full = assert_resumes_identically(make_loader, iterate=two_epochs, same=same)
    whole = list(make_loader())
    assert len(full) > len(whole) and not same_batches([b["input_ids"] for b in full[:len(whole)]],
                                                         [b["input_ids"] for b in full[len(whole):]])


def test_a_pass_left_early_counts_as_a_pass_as_in_loaders_dataloader(urls):
    reference = make(urls)
    epochs = [ids(reference) for _ in range(2)]
    assert not same_batches(*epochs)
    loader = make(urls)
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(2)]
    it.close()
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 2)  # where it was left: the rest of epoch 0 resumes
    assert same_batches(ids(loader), epochs[1])  # the next pass is epoch 1, from its start
    resumed = make(urls)
    resumed.load_state_dict(state)
    assert same_batches(head + ids(resumed), epochs[0])
    assert same_batches(ids(resumed), epochs[1])


def test_a_pass_never_read_counts_too(urls):
    reference = make(urls)
    epochs = [ids(reference) for _ in range(2)]
    assert not same_batches(*epochs)
    loader = make(urls)
    iter(loader)
    assert same_batches(ids(loader), epochs[1])


def test_loaders_over_one_stream_take_turns_at_its_epochs(urls):
    """A TokenLoader and a loaders.DataLoader over one stream: every pass of either is the stream's next epoch."""
    stream = ShardStream(urls, shuffle=True, seed=5)
    tokens = TokenLoader(stream, seq_len=128, batch_size=4)
    samples = DataLoader(stream, batch_size=8, collate_fn=lambda b: [s["__key__"] for s in b])
    first = ids(tokens)
    list(samples)  # epoch 1
    assert tokens.state_dict()["epoch"] == 2
    third = ids(tokens)
    for epoch, expected in ((0, first), (2, third)):
        chosen = make(urls, "stream")
        chosen.set_epoch(epoch)
        assert same_batches(ids(chosen), expected)


def test_ranks_split_every_epoch_and_reshuffle_it(urls):
    def rank_loader(rank):
        return TokenLoader(ShardStream(urls, shuffle=True, seed=5, rank=rank, world_size=2), seq_len=128, batch_size=4)

    per_rank = []
    for rank in range(2):
        loader = rank_loader(rank)
        first = whole_pass(loader)
        resumed = rank_loader(rank)
        resumed.load_state_dict(loader.state_dict())  # the rank's state between passes: its next epoch
        per_rank.append([first, whole_pass(loader)])
        assert same_batches(ids(resumed), [b["input_ids"] for b in per_rank[-1][1]])
    for epoch in range(2):
        tokens = [t for rank in per_rank for b in rank[epoch] for t in real_tokens(b).tolist()]
        assert set(tokens) == set(EVERY_TOKEN)  # every document (padding may repeat one)
    for rank in per_rank:
        assert not same_batches([b["input_ids"] for b in rank[0]], [b["input_ids"] for b in rank[1]])


def test_set_epoch_keeps_a_loaded_state_of_its_epoch_and_drops_another(urls):
    reference = make(urls)
    epochs = [ids(reference) for _ in range(4)]
    loader = make(urls)
    it = iter(loader)
    head = [next(it)["input_ids"]]
    state = loader.state_dict()
    it.close()
    kept, dropped = make(urls), make(urls)
    for resumed, epoch in ((kept, 0), (dropped, 3)):
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)
    assert same_batches(head + ids(kept), epochs[0])
    assert dropped.state_dict()["epoch"] == 3 and same_batches(ids(dropped), epochs[3])
