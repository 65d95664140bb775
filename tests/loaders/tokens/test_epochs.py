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


# ---- a resumed pass begun but never read -------------------------------------------------------------------------
SMALL = lengths(30, seed=3, high=150)  # 12 batches an epoch at seq_len=64, batch_size=2


def small(urls, batching="packed"):
    from tests.loaders.tokens.test_loader import tl

    return tl(urls, seq_len=64, batch_size=2, batching=batching, max_tokens=256)


def mid_epoch_state(make_loader, batches=2):
    loader = make_loader()
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(batches)]
    state = loader.state_dict()
    it.close()
    assert (state["epoch"], state["batches"]) == (0, batches)
    return state, head


def same_state(a, b):
    """Two TokenLoader states are the same position (the stream's, the batcher's, the batches handed out)."""
    import numpy as np

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, torch.Tensor)) or isinstance(b, (np.ndarray, torch.Tensor)):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def begin_unread(loader, how):
    """A pass begun and never read: its iterator dropped, closed, or kept (the next iter() stops it)."""
    it = iter(loader)
    if how == "closed":
        it.close()
    return it if how == "kept" else None


@pytest.mark.parametrize("how", ["dropped", "closed", "kept"])
@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_a_resumed_pass_never_read_counts_as_its_epoch_and_leaves_nothing_to_the_next(tmp_path, batching, how):
    """As loaders.DataLoader over a ShardStream: iter() after load_state_dict is the resumed pass (epoch 0) even unread,
    state_dict() is still the loaded state, and the next pass is epoch 1, whole (was: the loaded batcher's buffered
    documents, the rest of epoch 0, then epoch 1, in one pass)."""
    urls = write_token_shards(tmp_path, SMALL, per_shard=10)
    reference = small(urls, batching)
    epochs = [ids(reference) for _ in range(3)]
    state, head = mid_epoch_state(lambda: small(urls, batching))
    loader = small(urls, batching)
    loader.load_state_dict(state)
    kept = begin_unread(loader, how)
    assert same_state(loader.state_dict(), state)  # the loaded state, nothing of it read
    after = ids(loader)
    del kept
    assert same_batches(after, epochs[1])  # never two epochs in one pass
    assert same_batches(ids(loader), epochs[2])
    resumed = small(urls, batching)  # and the state taken in between still resumes the rest of epoch 0
    resumed.load_state_dict(state)
    assert same_batches(head + ids(resumed), epochs[0])


def test_the_rule_is_loaders_dataloaders(tmp_path):
    """The same sequence over a loaders.DataLoader of a ShardStream: the pass after an unread resumed one is epoch 1."""
    urls = write_token_shards(tmp_path, SMALL, per_shard=10)

    def samples():
        return DataLoader(ShardStream(urls, shuffle=True, seed=5), batch_size=3,
                          collate_fn=lambda b: [s["__key__"] for s in b])

    reference = samples()
    epochs = [list(reference) for _ in range(2)]
    loader = samples()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    it.close()
    resumed = samples()
    resumed.load_state_dict(state)
    iter(resumed)
    assert resumed.state_dict()["batches"] == state["batches"]
    assert list(resumed) == epochs[1]


@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_set_epoch_after_a_resumed_pass_never_read_is_that_epoch_whole(tmp_path, batching):
    """set_epoch(0) after the unread resumed pass of epoch 0: state_dict() is epoch 0's start, and so is the pass
    (was: the rest of epoch 0, from the stream's and the batcher's loaded positions)."""
    urls = write_token_shards(tmp_path, SMALL, per_shard=10)
    reference = small(urls, batching)
    epoch0 = ids(reference)
    state, _ = mid_epoch_state(lambda: small(urls, batching))
    loader = small(urls, batching)
    loader.load_state_dict(state)
    iter(loader)
    loader.set_epoch(0)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (0, 0)
    assert same_batches(ids(loader), epoch0)


@pytest.mark.parametrize("batching", ["packed", "dynamic"])
def test_set_epoch_after_a_resumed_pass_that_read_only_buffered_documents_is_that_epoch_whole(tmp_path, batching):
    """A mid-epoch state whose batcher holds the rest of the epoch (the stream read to its end): the resumed pass's
    first batches never read the stream, which takes its loaded position only when first read; set_epoch(0) then
    gives epoch 0 whole (was: an empty pass, the stream resuming the loaded position at its end)."""
    urls = write_token_shards(tmp_path, SMALL, per_shard=10)
    reference = small(urls, batching)
    epoch0 = ids(reference)
    state, head = mid_epoch_state(lambda: small(urls, batching))
    assert state["stream"]["workers"][0]["done"]  # every document read: the rest sits in the batcher
    loader = small(urls, batching)
    loader.load_state_dict(state)
    it = iter(loader)
    assert torch.equal(next(it)["input_ids"], epoch0[len(head)])
    it.close()
    loader.set_epoch(0)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (0, 0)
    assert same_batches(ids(loader), epoch0)


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_of_passes_follow_the_rule(tmp_path, seed):
    """Random passes begun unread (dropped, closed, kept), read in part, read whole; set_epoch; load_state_dict of a
    state taken earlier: each pass yields what the rule says, and state_dict() is where the rule says.

    The rule (loaders.DataLoader's): a pass runs at a loaded state's position if one is pending (it is taken by
    iter(), read or not), else at the start of the next epoch: the one set_epoch chose, else the one after the
    last pass begun. set_epoch drops a pending state of another epoch. state_dict(): a pending state; else after a
    pass read to its end, or set_epoch, the start of the next epoch; else the pass's epoch and its batches
    handed out. Epoch ``e`` from batch ``k`` is batches ``k:`` of what a fresh loader set to ``e`` yields."""
    import random

    rng = random.Random(seed)
    batching = ["packed", "dynamic"][seed % 2]
    urls = write_token_shards(tmp_path, SMALL, per_shard=10)
    whole = {}

    def epoch(e):
        if e not in whole:
            fresh = small(urls, batching)
            fresh.set_epoch(e)
            whole[e] = ids(fresh)
        return whole[e]

    loader = small(urls, batching)
    pending, next_epoch, where = None, 0, (0, 0)  # the model: pending (epoch, batch), next epoch, state_dict()
    saved = []  # (state, its (epoch, batch))
    kept = None
    for step in range(40):
        op = rng.choice(["unread", "partial", "partial", "whole", "set_epoch", "load", "load", "save"])
        ctx = f"seed {seed} step {step} {op}"
        if op in ("unread", "partial", "whole"):
            e, k = pending if pending is not None else (next_epoch, 0)
            pending, next_epoch = None, e + 1
            expected = epoch(e)[k:]
            if op == "unread":
                kept = begin_unread(loader, rng.choice(["dropped", "closed", "kept"]))
                where = (e, k)
            elif op == "partial":
                n = rng.randrange(1, len(expected)) if len(expected) > 1 else 0
                it = iter(loader)
                got = [next(it)["input_ids"] for _ in range(n)]
                it.close()
                assert same_batches(got, expected[:n]), ctx
                where = (e, k + n)
            else:
                got = ids(loader)
                assert same_batches(got, expected), f"{ctx}: {len(got)} batches, expected {len(expected)}"
                where = (e + 1, 0)
        elif op == "set_epoch":
            x = rng.randrange(0, next_epoch + 2)
            loader.set_epoch(x)
            pending = pending if pending is not None and pending[0] == x else None
            next_epoch = x
            where = pending or (x, 0)
        elif op == "load" and saved:
            state, pos = rng.choice(saved)
            loader.load_state_dict(state)
            pending = where = pos
        state = loader.state_dict()
        assert (state["epoch"], state["batches"]) == where, ctx
        if op == "save" or rng.random() < 0.3:
            saved.append((state, where))
    del kept
