"""loaders.DataLoader over ShardStream: exact mid-epoch resume with workers, and epochs after it."""
import pytest

from datapipe import ShardStream
from loaders import DataLoader
from tests.shards import write_shards
from tests.resume import assert_resumes_identically


def keys(batch):
    return [s["__key__"] for s in batch]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_resume_with_workers_at_every_step(tmp_path, num_workers):
    urls, samples = write_shards(tmp_path / "d", [7, 2, 9, 4])

    def make():
        stream = ShardStream(urls, shuffle=True, shuffle_buffer=5, seed=3, rank=0, world_size=2)
        return DataLoader(stream, batch_size=2, num_workers=num_workers, collate_fn=keys)

    # every step without workers; a few (worker start-up is slow on CI's 2 cores) with them
    full = assert_resumes_identically(make, steps=None if num_workers == 0 else (1, 3, 5))
    flat = [k for b in full for k in b]
    assert len(flat) == 11 and len(set(flat)) == 11


def test_epochs_after_a_resume_start_afresh(tmp_path):
    urls, _ = write_shards(tmp_path / "d", [6, 6])

    def make():
        return DataLoader(ShardStream(urls, shuffle=True, shuffle_buffer=4), batch_size=2, num_workers=2,
                          collate_fn=keys)

    reference = make()
    epoch0 = list(reference)
    epoch1 = list(reference)
    assert epoch0 != epoch1  # the loader advances the epoch, and the stream reshuffles

    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + list(resumed) == epoch0
    assert list(resumed) == epoch1


@pytest.mark.parametrize("change, words", [({"seed": 4}, ["seed=3", "seed=4"]),
                                           ({"shuffle": False}, ["shuffle=True", "shuffle=False"]),
                                           ({"shuffle_buffer": 2}, ["shuffle_buffer=5", "shuffle_buffer=2"]),
                                           ({"shards": 3}, ["shards='4 shards", "shards='3 shards"])])
@pytest.mark.parametrize("whole_job", [False, True])
def test_a_checkpoint_of_other_settings_is_refused_at_load_time(tmp_path, change, words, whole_job):
    urls, _ = write_shards(tmp_path / "d", [7, 2, 9, 4])
    settings = {"shuffle": True, "shuffle_buffer": 5, "seed": 3}

    def make(**changes):
        shards = urls[:changes.pop("shards", len(urls))]
        return DataLoader(ShardStream(shards, **{**settings, **changes}), batch_size=2, collate_fn=keys)

    saved = make()
    it = iter(saved)
    next(it), next(it)
    state = saved.global_state_dict() if whole_job else saved.state_dict()
    other = make(**change)
    with pytest.raises(ValueError, match="taken over other data or settings") as info:
        other.load_state_dict(state)  # refused here, not at the first batch of the next epoch
    for word in words:
        assert word in str(info.value)
    same = make()
    same.load_state_dict(state)
    assert [k for b in same for k in b] == [k for b in it for k in b]


def _fails_on_every_third(sample):
    if int(sample["cls"]) % 3 == 0:
        raise ValueError("bad sample")
    return sample["__key__"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_losses_are_per_pass_like_samples_with_totals_beside(tmp_path, num_workers):
    urls, samples = write_shards(tmp_path / "d", [7, 5])
    bad = sum(int(s["cls"]) % 3 == 0 for s in samples)
    stream = ShardStream(urls, on_error="skip").map(_fails_on_every_third)
    loader = DataLoader(stream, batch_size=2, num_workers=num_workers, collate_fn=list)
    for epoch in (1, 2, 3):
        got = [k for b in loader for k in b]
        s = loader.stats()
        assert len(got) == s["samples"] == len(samples) - bad
        assert (s["skipped"], s["errors"]) == (bad, bad)  # this pass's, as samples is
        assert (s["skipped_total"], s["errors_total"]) == (bad * epoch, bad * epoch)
        assert s["padded"] == s["padded_total"] == 0
    assert "skipped_total" in DataLoader.stats.__doc__ and "errors_total" in DataLoader.stats.__doc__


@pytest.mark.parametrize("mixed", [False, True])
def test_persistent_workers_follow_each_epoch_as_fresh_workers_do(tmp_path, mixed):
    """Persistent workers keep the stream copy they started with; each pass still reshuffles by the epoch the main
    process set (the loader's own, or the user's set_epoch): the same orders as workers started afresh each pass."""
    from datapipe import mix

    urls, _ = write_shards(tmp_path / "d", [6, 6, 6, 6])

    def make(persistent):
        stream = ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=4)
        if mixed:
            stream = mix([stream, ShardStream(urls[:2], shuffle=True, seed=5)], weights=[0.5, 0.5], seed=6)
        return DataLoader(stream, batch_size=3, num_workers=2, persistent_workers=persistent, collate_fn=keys)

    def passes(loader):
        out = [list(loader) for _ in range(3)]
        loader.dataset.set_epoch(7)  # the user's own choice of epoch reaches the workers too
        return out + [list(loader)]

    fresh, persistent = passes(make(False)), passes(make(True))
    assert persistent == fresh
    assert len({str(p) for p in fresh}) == 4  # every pass its own order


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_second_loader_over_the_same_stream_never_repeats_an_epoch(tmp_path, num_workers):
    """Issue #44: loader B over the stream loader A ran three epochs on gave A's orders 2, 1, 2 again. Every pass over
    any loader of one stream is a fresh epoch, and each loader's state names the epoch the stream runs."""
    urls, samples = write_shards(tmp_path / "d", [5, 5, 5, 5, 5, 5])
    stream = ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=2)

    def make():
        return DataLoader(stream, batch_size=3, num_workers=num_workers, collate_fn=keys)

    def run(loader):
        order = [k for b in loader for k in b]
        assert sorted(order) == sorted(s["__key__"] for s in samples)  # nothing lost
        return order

    a = make()
    orders = [run(a) for _ in range(3)]
    b = make()
    assert b.state_dict()["epoch"] == 3  # where B's next pass starts, as the stream will run it
    for _ in range(3):
        orders.append(run(b))
        assert b.state_dict()["epoch"] == stream.epoch + 1
    it = iter(a)  # A again, left after two batches: it still counts as a pass, and its state names its epoch
    next(it), next(it)
    assert a.state_dict()["epoch"] == stream.epoch == 6 and a.state_dict()["batches"] == 2
    del it
    orders.append(run(a))
    assert len({tuple(o) for o in orders}) == len(orders) == 7
    b.set_epoch(1)  # an explicit epoch is the user's choice: it repeats, and the passes count on from it
    assert run(b) == orders[1] and run(b) == orders[2]
    stream.set_epoch(0)  # on the stream too, for whichever loader runs next
    assert run(a) == orders[0]


@pytest.mark.parametrize("mixed", [False, True])
def test_loaders_over_one_stream_take_turns_with_persistent_workers_and_mix(tmp_path, mixed):
    """Two loaders over one stream (persistent workers or not, a mix too): every pass its own epoch."""
    from datapipe import mix

    urls, _ = write_shards(tmp_path / "d", [4, 4, 4, 4])
    data = ShardStream(urls, shuffle=True, shuffle_buffer=3, seed=1)
    if mixed:
        data = mix([data, ShardStream(urls[:2], shuffle=True, seed=5)], weights=[0.5, 0.5], seed=6)
    a = DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True, collate_fn=keys)
    b = DataLoader(data, batch_size=2, num_workers=2, collate_fn=keys)
    orders = [tuple(k for batch in loader for k in batch) for loader in (a, b, a, b, a)]
    assert data.epoch == 4 and len(set(orders)) == 5
    a.close()


def test_a_resume_on_a_stream_that_ran_later_epochs_follows_the_checkpoint(tmp_path):
    """An explicit epoch wins over the count: a checkpoint of epoch 0 loaded after epochs 0-2 ran in this process
    resumes exactly, and the pass after it is epoch 1, as in the run that took it."""
    urls, _ = write_shards(tmp_path / "d", [6, 6, 6])
    stream = ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=3)
    kw = dict(batch_size=2, num_workers=2, collate_fn=keys)
    first = DataLoader(stream, **kw)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    ran = [list(first) for _ in range(2)]  # epochs 1 and 2: the abandoned pass counted as epoch 0
    assert state["epoch"] == 0 and stream.epoch == 2
    reference = DataLoader(ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=3), **kw)
    epoch0, epoch1 = list(reference), list(reference)
    assert ran[0] == epoch1
    resumed = DataLoader(stream, **kw)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["epoch"] == 0
    assert head + list(resumed) == epoch0
    assert list(resumed) == epoch1 and resumed.state_dict()["epoch"] == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_data_error_from_a_worker_keeps_its_url_and_key(tmp_path, num_workers):
    """Issue #44: with workers, torch rebuilds the DataError from its text: e.url and e.key were None."""
    import torch.utils.data

    from datapipe import DataError

    urls, samples = write_shards(tmp_path / "d", [3, 3])

    def bad(sample):
        if sample["__key__"] == samples[4]["__key__"]:
            raise ValueError("boom")
        return sample

    for loader_type in (DataLoader, torch.utils.data.DataLoader):
        loader = loader_type(ShardStream(urls).map(bad), batch_size=2, num_workers=num_workers, collate_fn=keys)
        with pytest.raises(DataError, match="boom") as info:
            list(loader)
        assert (info.value.url, info.value.key) == (urls[1], samples[4]["__key__"]), loader_type


SHAPES = [(0, False), (2, False), (2, True)]  # (num_workers, persistent_workers)


def _resume_setup(tmp_path, num_workers, persistent, mixed):
    """A loader factory over a ShardStream (or a mix of two), and a state taken after two batches of epoch 0."""
    from datapipe import mix

    urls, samples = write_shards(tmp_path / "d", [6, 6])
    other, _ = write_shards(tmp_path / "e", [5, 5], prefix="o")

    def make():
        data = ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=1)
        if mixed:
            data = mix([data, ShardStream(other, shuffle=True, seed=2)], weights=[1, 1], seed=3)
        return DataLoader(data, batch_size=2, num_workers=num_workers, persistent_workers=persistent,
                          collate_fn=keys)

    first = make()
    it = iter(first)
    head = [k for _ in range(2) for k in next(it)]
    state = first.state_dict()
    rest = [k for b in it for k in b]
    first.close()
    return make, state, head, rest, sorted(s["__key__"] for s in samples)


def _epoch(make, epoch):
    """Epoch ``epoch`` and the one after it, as a fresh loader runs them."""
    loader = make()
    loader.set_epoch(epoch)
    out = [[k for b in loader for k in b] for _ in range(2)]
    loader.close()
    return out


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("then, epoch", [("set_epoch", 0), ("iter", 1), ("set_epoch", 2)])
@pytest.mark.parametrize("num_workers, persistent", SHAPES)
def test_a_resumed_pass_made_and_never_read_counts_as_the_pass(tmp_path, num_workers, persistent, then, epoch,
                                                               mixed):
    """load_state_dict, an iter() never read, then set_epoch (of the saved epoch or another) or not, then a new pass:
    the unread pass took the resume (as TokenLoader's does), so the new pass is a whole epoch, with any worker count,
    persistent workers or not. Was: without workers, the rest of epoch 0 after set_epoch(0), and under a mix the
    rest's positions applied to epoch 1 / 2; with persistent workers the rest of epoch 0 after set_epoch(0)."""
    make, state, _, _, every = _resume_setup(tmp_path, num_workers, persistent, mixed)
    whole, after = _epoch(make, epoch)
    loader = make()
    loader.load_state_dict(state)
    unread = iter(loader)
    if then == "set_epoch":
        loader.set_epoch(epoch)
    got = [k for b in loader for k in b]
    assert got == whole
    if not mixed:
        assert sorted(got) == every  # the same samples with every worker count: the whole epoch
    assert [k for b in loader for k in b] == after
    del unread
    loader.close()


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("num_workers, persistent", SHAPES)
def test_a_later_pass_at_the_resumed_epoch_is_whole(tmp_path, num_workers, persistent, mixed):
    """A resumed pass read to its end, then set_epoch of its epoch: the whole epoch, as without a resume. Was: with
    persistent workers the rest again (their stream copies kept the resume they started with)."""
    make, state, head, rest, every = _resume_setup(tmp_path, num_workers, persistent, mixed)
    (whole, _), = [_epoch(make, 0)]
    loader = make()
    loader.load_state_dict(state)
    assert [k for b in loader for k in b] == rest
    assert head + rest == whole
    loader.set_epoch(0)
    got = [k for b in loader for k in b]
    assert got == whole
    if not mixed:
        assert sorted(got) == every
    loader.close()


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("num_workers, persistent", SHAPES)
def test_a_state_taken_on_an_unread_resumed_pass_is_the_loaded_one(tmp_path, num_workers, persistent, mixed):
    """state_dict() on a resumed pass made and never read is the position loaded (with any worker count): loaded
    again it yields the rest, the same rest the unread pass yields when read."""
    make, state, _, rest, _ = _resume_setup(tmp_path, num_workers, persistent, mixed)
    loader = make()
    loader.load_state_dict(state)
    unread = iter(loader)
    taken = loader.state_dict()
    assert (taken["epoch"], taken["batches"]) == (0, 2)
    assert taken["dataset"]["workers"] == state["dataset"]["workers"]
    again = make()
    again.load_state_dict(taken)
    assert [k for b in again for k in b] == rest
    assert [k for b in unread for k in b] == rest
    again.close()
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("how", ["counted", "set_epoch", "resumed"])
def test_two_iterators_made_before_either_is_read_run_their_own_epochs(tmp_path, num_workers, how):
    """Iterator A made for epoch 0, B for epoch 1, then both read: A is epoch 0 (or its resumed rest), B epoch 1,
    with and without workers."""
    urls, _ = write_shards(tmp_path / "d", [6, 3, 7])

    def make():
        return DataLoader(ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=5), batch_size=2,
                          num_workers=num_workers, collate_fn=keys)

    reference = make()
    epoch0, epoch1 = list(reference), list(reference)
    assert epoch0 != epoch1
    loader, skip = make(), 0
    if how == "resumed":
        head = make()
        it = iter(head)
        next(it), next(it)
        loader.load_state_dict(head.state_dict())
        skip = 2
    if how == "set_epoch":
        loader.set_epoch(0)
    a = iter(loader)
    if how != "counted":
        loader.set_epoch(1)
    b = iter(loader)
    got_b = [next(b)]
    got_a = list(a)
    got_b += list(b)
    assert got_a == epoch0[skip:]
    assert got_b == epoch1
