"""loaders.DataLoader's epochs and state (loaders/dataloader/state.py): seed + epoch, exact resume (map-style,
plain iterable and worker-state protocol datasets), the state's kind."""
import pytest
import torch

from loaders import DataLoader
from tests.loaders.toy_datasets import (SHARDS, Counting, Squares, ToyStream, children_gone, plain, run,
                                        threads_gone)


def test_seed_plus_epoch_and_set_epoch():
    ds = Squares()
    dl = DataLoader(ds, batch_size=4, shuffle=True, seed=3)
    e0, e1 = run(dl), run(dl)  # a finished pass advances the epoch
    ref = lambda s: run(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True,  # noqa: E731
                                                     generator=torch.Generator().manual_seed(s)))
    assert e0 == ref(3) and e1 == ref(4) and e0 != e1
    dl.set_epoch(0)
    assert run(dl) == e0
    assert len(dl) == len(e0)


def test_seed_plus_epoch_alone_sets_the_order_over_persistent_workers_too():
    def make(persistent):
        return DataLoader(Squares(), batch_size=4, shuffle=True, seed=3, num_workers=2, persistent_workers=persistent)

    a = make(True)
    run(a)
    later = run(a)  # epoch 1, over the workers of epoch 0 (a reset torch iterator: no base seed drawn)
    a.close()
    b, c = make(True), make(False)
    b.set_epoch(1)
    c.set_epoch(1)
    assert later == run(b) == run(c)
    b.close()
    c.close()


@pytest.mark.parametrize("workers,device", [(0, None), (2, None), (0, "cpu")])
def test_map_style_resume_exact_without_loading_skipped(workers, device):
    kw = dict(batch_size=4, shuffle=True, num_workers=workers, seed=5, device=device)
    full = run(DataLoader(Squares(), **kw))
    n = len(full)
    for stop in (0, 1, 3, n - 1, n):
        first = DataLoader(Squares(), **kw)
        head = run(first, limit=stop) if stop else []
        state = first.state_dict()
        first.close()
        assert state["epoch"] == 0 and state["batches"] == stop
        ds = Squares()
        second = DataLoader(ds, **kw)
        second.load_state_dict(state)
        rest = run(second)
        assert head + rest == full, stop
        if workers == 0:  # skipped batches were never loaded
            assert sorted(ds.loaded) == sorted(i for b in rest for i in b["i"][2])
    assert children_gone()


def test_map_style_resume_with_user_generator():
    kw = dict(batch_size=3, shuffle=True)

    def fresh(seed=1):
        return DataLoader(Squares(), generator=torch.Generator().manual_seed(seed), **kw)

    ref = fresh()
    run(ref)
    second_pass = run(ref)  # the generator advanced during the first pass
    a = fresh()
    run(a)
    head = run(a, limit=2)
    state = a.state_dict()
    assert state["generator_state"] is not None
    b = fresh(seed=123)  # its own generator is replaced by the saved state
    b.load_state_dict(state)
    assert head + run(b) == second_pass


@pytest.mark.parametrize("seeding", ["generator", "seed"])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_later_pass_over_persistent_workers_resumes_exact(seeding, device):
    """A pass that reuses persistent workers draws its order from the generator without drawing a base seed
    first (torch's iterator is reset, not made); its resume makes a new iterator, which does. The rest of the
    pass still comes back as it would have: no sample twice, none missing."""
    def make():
        kw = dict(generator=torch.Generator().manual_seed(7)) if seeding == "generator" else dict(seed=7)
        dl = DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True,
                        device=device, **kw)
        for _ in dl:  # a pass left early (its workers persist), then a whole one
            break
        run(dl)
        return dl

    a = make()
    full = run(a)  # the third pass, over the workers of the first
    a.close()
    c = make()
    head = run(c, limit=2)
    state = c.state_dict()
    c.close()
    b = DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True, device=device,
                   **(dict(generator=torch.Generator().manual_seed(99)) if seeding == "generator" else dict(seed=7)))
    b.load_state_dict(state)
    assert head + run(b) == full
    b.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_taken_between_epochs_carries_the_users_generator(persistent):
    """Between epochs (0 batches of the next handed out) the next order hangs on the user's generator, which
    the first pass moved on: the state carries it, so the resumed epoch is the one the run would have had."""
    def make(seed):
        return DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2 if persistent else 0,
                          persistent_workers=persistent, generator=torch.Generator().manual_seed(seed))

    a = make(1)
    run(a)
    state = a.state_dict()
    assert state["batches"] == 0 and state["generator_state"] is not None
    following = run(a)
    a.close()
    b = make(99)
    b.load_state_dict(state)
    assert run(b) == following
    b.close()


def test_a_state_loaded_into_a_loader_whose_persistent_workers_run_rewinds_exactly():
    dl = DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True,
                    generator=torch.Generator().manual_seed(5))
    start = dl.state_dict()  # before any pass: no workers yet
    first = run(dl)
    mid = run(dl, limit=1)
    dl.load_state_dict(start)  # the workers run on: the rewound pass resets them, drawing no base seed itself
    assert run(dl) == first
    dl.close()
    assert mid


def test_loading_a_state_leaves_an_older_pass_running_side_by_side():
    dl = DataLoader(Squares(), batch_size=3, shuffle=True, device="cpu", generator=torch.Generator().manual_seed(5))
    whole = run(dl)
    dl = DataLoader(Squares(), batch_size=3, shuffle=True, device="cpu", generator=torch.Generator().manual_seed(5))
    older = iter(dl)
    head = [next(older)]
    newer = iter(dl)
    next(newer)
    dl.load_state_dict(dl.state_dict())
    assert [plain(b) for b in head] + [plain(b) for b in older] == whole  # older, still alive, is not stopped
    dl.close()


def test_resume_of_finished_epoch_moves_on():
    dl = DataLoader(Squares(), batch_size=5, shuffle=True, seed=0)
    run(dl)
    state = dl.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 0
    nxt = DataLoader(Squares(), batch_size=5, shuffle=True, seed=0)
    nxt.load_state_dict(state)
    assert run(nxt) == run(DataLoader(Squares(), batch_size=5, shuffle=True, seed=1))


def test_iterable_without_protocol_replays():
    kw = dict(batch_size=3, num_workers=2)
    full = run(DataLoader(Counting(), **kw))
    a = DataLoader(Counting(), **kw)
    head = run(a, limit=4)
    b = DataLoader(Counting(), **kw)
    b.load_state_dict(a.state_dict())
    a.close()
    assert head + run(b) == full
    with pytest.raises(ValueError, match="num_workers"):
        DataLoader(Counting(), batch_size=3, num_workers=1).load_state_dict(a.state_dict())


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_protocol_resume_exact_at_every_stop(workers):
    kw = dict(batch_size=2, num_workers=workers)
    full = run(DataLoader(ToyStream(SHARDS), **kw))
    assert len(full) >= 8
    for stop in range(0, len(full) + 1):
        a = DataLoader(ToyStream(SHARDS), **kw)
        head = run(a, limit=stop) if stop else []
        state = a.state_dict()
        a.close()
        b = DataLoader(ToyStream(SHARDS), **kw)
        b.load_state_dict(state)
        assert head + run(b) == full, (workers, stop, state)
    assert children_gone()


def test_protocol_resume_twice_and_next_epoch():
    kw = dict(batch_size=2, num_workers=2)
    ref = DataLoader(ToyStream(SHARDS), **kw)
    full0, full1 = run(ref), run(ref)
    a = DataLoader(ToyStream(SHARDS), **kw)
    got = run(a, limit=1)
    b = DataLoader(ToyStream(SHARDS), **kw)
    b.load_state_dict(a.state_dict())
    a.close()
    got += run(b, limit=3)  # resumed run stopped again (first_worker composes)
    c = DataLoader(ToyStream(SHARDS), **kw)
    c.load_state_dict(b.state_dict())
    b.close()
    got += run(c)
    assert got == full0
    assert run(c) == full1  # the following epoch starts fresh
    assert full0 != full1


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_protocol_state_shape_and_worker_count_check():
    a = DataLoader(ToyStream(SHARDS), batch_size=2, num_workers=2)
    run(a, limit=3)
    state = a.state_dict()
    a.close()
    ds = state["dataset"]
    assert set(ds) == {"epoch", "num_workers", "workers", "first_worker"}
    assert ds["num_workers"] == 2 and ds["first_worker"] == 1 and set(ds["workers"]) == {0, 1}
    with pytest.raises(ValueError, match="num_workers"):
        DataLoader(ToyStream(SHARDS), batch_size=2, num_workers=3).load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict"):
        DataLoader(ToyStream(SHARDS), batch_size=2).load_state_dict({"epoch": 0})


def test_protocol_resume_through_cpu_prefetch():
    kw = dict(batch_size=2, num_workers=2, device="cpu", prefetch_depth=3)
    full = run(DataLoader(ToyStream(SHARDS), **kw))
    a = DataLoader(ToyStream(SHARDS), **kw)
    head = run(a, limit=5)  # the prefetcher ran ahead; the state must not count those batches
    state = a.state_dict()
    a.close()
    assert state["batches"] == 5
    b = DataLoader(ToyStream(SHARDS), **kw)
    b.load_state_dict(state)
    assert head + run(b) == full
    b.close()
    assert threads_gone() and children_gone()


def test_state_names_its_kind_and_another_kind_is_refused():
    state = DataLoader(ToyStream(SHARDS), batch_size=2).state_dict()
    assert state["kind"] == "DataLoader"  # datapipe.state: every state says what it is
    with pytest.raises(ValueError, match="ImageLoader state, not a DataLoader state"):
        DataLoader(ToyStream(SHARDS), batch_size=2).load_state_dict({**state, "kind": "ImageLoader"})


@pytest.mark.parametrize("mixed", [False, True])
def test_a_resumed_pass_with_workers_leaves_the_shared_stream_whole(tmp_path, mixed):
    """Resuming one loader does not shorten the next pass of another loader over the same stream object."""
    from datapipe import ShardStream, mix
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "d", [9, 7, 8, 6])

    def make_data():
        stream = ShardStream(urls, shuffle=True, seed=1)
        return mix([stream, ShardStream(urls)], weights=[1, 1], seed=2) if mixed else stream

    kw = dict(batch_size=3, num_workers=2, collate_fn=lambda b: [s["__key__"] for s in b])

    def whole(epoch):  # a mix's epoch (stop="first") holds another count each epoch
        reference = DataLoader(make_data(), **kw)
        reference.set_epoch(epoch)
        return sum(len(b) for b in reference)

    data = make_data()
    assert sum(len(b) for b in DataLoader(data, **kw)) == whole(0)
    first = DataLoader(data, **kw)
    it = iter(first)  # epoch 1: every pass over the stream is a fresh epoch
    head = len(next(it))
    state = first.state_dict()
    del it
    resumed = DataLoader(data, **kw)
    resumed.load_state_dict(state)
    assert state["epoch"] == 1 and head + sum(len(b) for b in resumed) == whole(1)
    again = DataLoader(data, **kw)
    again.set_epoch(1)  # a new loader at the resumed epoch: the whole epoch, not the rest the workers took
    assert sum(len(b) for b in again) == whole(1)
    assert sum(len(b) for b in first) == whole(2)
    first.close()
    assert children_gone()


SET_EPOCH_SHAPES = [(0, False), (2, False), (2, True)]  # (num_workers, persistent_workers)


def _flat(batches):
    return [k for b in batches for k in b]


def _loader_factory(tmp_path, data, num_workers, persistent):
    """A loader factory over a shuffled ShardStream or a shuffled map-style dataset (with ``generator=``: the next
    pass's order depends on the generator's state, which the state must carry), and every sample's key."""
    from datapipe import ShardStream
    from tests.shards import write_shards

    kw = dict(batch_size=2, num_workers=num_workers, persistent_workers=persistent)
    if data == "stream":
        urls, samples = write_shards(tmp_path / "d", [6, 6])
        every = sorted(s["__key__"] for s in samples)

        def make():
            return DataLoader(ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=1),
                              collate_fn=lambda b: [s["__key__"] for s in b], **kw)
    else:
        every = list(range(12))

        def make():
            return DataLoader(Squares(12), shuffle=True, generator=torch.Generator().manual_seed(7),
                              collate_fn=lambda b: [s["i"] for s in b], **kw)
    return make, every


@pytest.mark.parametrize("read_after", ["none", "one", "all"])
@pytest.mark.parametrize("history", ["partial", "resumed"])
@pytest.mark.parametrize("data", ["stream", "map"])
@pytest.mark.parametrize("num_workers, persistent", SET_EPOCH_SHAPES)
def test_state_after_set_epoch_is_the_next_pass(tmp_path, num_workers, persistent, data, history, read_after):
    """A pass of epoch 1 left unfinished (read in part, or a resumed pass read in part), then set_epoch(1): the next
    pass is the whole epoch 1, so state_dict() is its start (``batches`` 0, the generator as that pass finds it), and
    a fresh loader resumed from it yields exactly what the uninterrupted run does, that pass and the one after.
    ``read_after``: the unfinished pass's iterator is read after set_epoch (torch allows it), one batch more or to its
    end: the state is still the next pass's start, and the next pass is still epoch 1 (set_epoch holds, as torch's
    ``sampler.set_epoch`` does). Was: the unfinished pass's position (epoch 1, batch 2), which resumed mid-epoch; and
    a pass read to its end after set_epoch(1) moved the next pass on to epoch 2."""
    make, every = _loader_factory(tmp_path, data, num_workers, persistent)
    loader = make()
    if history == "partial":
        loader.set_epoch(1)
        it = iter(loader)
        for _ in range(2):
            next(it)
    else:
        saver = make()
        saver.set_epoch(1)
        s_it = iter(saver)
        for _ in range(2):
            next(s_it)
        saved = saver.state_dict()
        assert saved["epoch"] == 1 and saved["batches"] == 2
        del s_it
        saver.close()
        loader.load_state_dict(saved)
        it = iter(loader)
        next(it)
    live = loader.state_dict()
    assert live["epoch"] == 1 and live["batches"] == (2 if history == "partial" else 3)  # the live pass, read on
    loader.set_epoch(1)
    if read_after == "one":
        next(it)
    elif read_after == "all":
        list(it)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 0 and state["dataset"] is None
    whole, after = _flat(loader), _flat(loader)  # the uninterrupted run: the whole epoch 1, then epoch 2
    assert sorted(whole) == every
    del it
    loader.close()

    resumed = make()
    resumed.load_state_dict(state)
    assert _flat(resumed) == whole
    assert _flat(resumed) == after
    resumed.close()
    if data == "stream":  # the whole epoch 1, as a fresh loader runs it
        fresh = make()
        fresh.set_epoch(1)
        assert _flat(fresh) == whole
        fresh.close()
    assert children_gone()


@pytest.mark.parametrize("data", ["stream", "map"])
@pytest.mark.parametrize("num_workers, persistent", SET_EPOCH_SHAPES)
def test_state_of_a_pass_left_without_set_epoch_stays_its_position(tmp_path, num_workers, persistent, data):
    """A pass left unfinished with no set_epoch since (``for b in loader: break``, then a checkpoint): the state is
    still that pass's position, and resumes its rest (the checkpoint a training loop takes as it stops)."""
    make, every = _loader_factory(tmp_path, data, num_workers, persistent)
    loader = make()
    loader.set_epoch(1)
    head = []
    for b in loader:
        head.append(b)
        if len(head) == 2:
            break
    state = loader.state_dict()
    loader.close()
    assert state["epoch"] == 1 and state["batches"] == 2
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.close()
    reference = make()
    reference.set_epoch(1)
    if data == "stream":
        assert head + rest == list(reference)
    else:
        assert sorted(_flat(head + rest)) == every
    reference.close()
    assert children_gone()


@pytest.mark.parametrize("num_workers, persistent", SET_EPOCH_SHAPES)
def test_state_after_set_epoch_carries_the_samplers_epoch(num_workers, persistent):
    """A sampler with its own epoch (``DistributedSampler``): a pass left unfinished, then set_epoch(2); the state is
    the start of epoch 2 with the sampler's epoch, so a fresh loader resumed from it (no set_epoch of its own) draws
    the same order as the uninterrupted run. Was: the fresh loader's sampler stayed at epoch 0."""
    from torch.utils.data.distributed import DistributedSampler

    def make():
        ds = Squares(12)
        return DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=3),
                          num_workers=num_workers, persistent_workers=persistent,
                          collate_fn=lambda b: [s["i"] for s in b])

    loader = make()
    it = iter(loader)
    next(it)
    loader.set_epoch(2)
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["batches"] == 0 and state["sampler_epoch"] == 2
    whole = _flat(loader)
    del it
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert _flat(resumed) == whole
    resumed.close()
    assert children_gone()
