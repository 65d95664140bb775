"""loaders.DataLoader against torch.utils.data.DataLoader's documented contract, side by side."""
import gc
import multiprocessing
import warnings

import pytest
import torch
from torch.utils.data import (BatchSampler, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, get_worker_info)

from loaders import DataLoader

TorchDL = torch.utils.data.DataLoader


class Items(Dataset):
    def __init__(self, n=8, bad=()):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise KeyError(i)
        return i


class Noisy(Dataset):
    """Each item draws from torch's RNG in whichever process loads it (worker seeds show here)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.randint(0, 1 << 30, ()).item()


class Stream(IterableDataset):
    def __init__(self, n=6, reported=None):
        self.n, self.reported = n, reported

    def __len__(self):
        return self.reported

    def __iter__(self):
        info = get_worker_info()
        w, k = (info.num_workers, info.id) if info else (1, 0)
        return iter(range(k, self.n, w))


def flat(loader, limit=None):
    out = []
    for b in loader:
        out.append(b.tolist() if isinstance(b, torch.Tensor) else b)
        if limit is not None and len(out) == limit:
            break
    return out


def with_errors(loader):
    """Every outcome of a pass, exceptions included (a pass goes on after a failing batch)."""
    out, it = [], iter(loader)
    while True:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            return out
        except KeyError:
            out.append("KeyError")


def both(*args, **kw):
    return DataLoader(*args, **kw), TorchDL(*args, **kw)


# ---------------------------------------------------------------- API surface ------------------------

def test_is_a_torch_dataloader_with_torch_attributes_and_signature():
    dl = DataLoader(Items(), 4, True)  # torch's positional order: dataset, batch_size, shuffle
    assert isinstance(dl, TorchDL)
    assert dl.batch_size == 4 and isinstance(dl.sampler, RandomSampler)
    ref = TorchDL(Items(), 4, True)
    for name in ("pin_memory", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers",
                 "generator", "multiprocessing_context", "in_order", "pin_memory_device", "drop_last",
                 "num_workers", "collate_fn"):
        assert getattr(dl, name) == getattr(ref, name), name
    assert DataLoader[list[torch.Tensor]] is not None  # Generic, like torch's
    assert len(dl) == len(ref) == 2


@pytest.mark.parametrize("attr,value", [("batch_size", 3), ("sampler", [0]), ("batch_sampler", [[0]]),
                                        ("drop_last", True), ("dataset", Items(2))])
def test_assigning_after_init_raises_like_torch(attr, value):
    for dl in both(Items(), batch_size=2):
        with pytest.raises(ValueError, match=attr):
            setattr(dl, attr, value)
    dl = DataLoader(Items(), batch_size=2)
    dl.num_workers = 1  # torch allows this one
    assert flat(dl) == [[0, 1], [2, 3], [4, 5], [6, 7]]


# ---------------------------------------------------------------- behaviour --------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_one_batch_does_not_end_the_pass(workers):
    ours, theirs = both(Items(bad={2, 3}), batch_size=2, num_workers=workers)
    expected = [[0, 1], "KeyError", [4, 5], [6, 7]]
    assert with_errors(theirs) == expected
    assert with_errors(ours) == expected


def test_an_error_through_device_prefetch_does_not_end_the_pass():
    dl = DataLoader(Items(bad={2}), batch_size=2, device="cpu")
    assert with_errors(dl) == [[0, 1], "KeyError", [4, 5], [6, 7]]
    dl.close()


def test_global_seed_drives_the_order_like_torch():
    def order(cls, seed):
        torch.manual_seed(seed)
        return flat(cls(Items(32), batch_size=32, shuffle=True))[0]

    assert order(DataLoader, 0) == order(TorchDL, 0)
    assert order(DataLoader, 1) == order(TorchDL, 1)
    assert order(DataLoader, 0) != order(DataLoader, 1)
    torch.manual_seed(0)
    dl = DataLoader(Items(32), batch_size=4, shuffle=True)
    firsts = [flat(dl, limit=1)[0] for _ in range(4)]  # a loop that always breaks early
    assert len({tuple(f) for f in firsts}) > 1


def test_worker_rng_comes_from_the_global_seed():
    def draws(cls, seed):
        torch.manual_seed(seed)
        return flat(cls(Noisy(), batch_size=None, num_workers=2))

    a, b = draws(DataLoader, 0), draws(DataLoader, 1)
    assert a != b  # two "program runs" with different seeds draw differently in workers
    assert a == draws(TorchDL, 0)


def test_resume_after_global_seeded_shuffle_is_exact():
    torch.manual_seed(3)
    full = flat(DataLoader(Items(20), batch_size=3, shuffle=True, num_workers=0))
    torch.manual_seed(3)
    a = DataLoader(Items(20), batch_size=3, shuffle=True)
    head = flat(a, limit=2)
    state = a.state_dict()
    assert state["rng_state"] is not None and isinstance(state["base_seed"], int)
    torch.manual_seed(99)  # a different program run
    b = DataLoader(Items(20), batch_size=3, shuffle=True)
    b.load_state_dict(state)
    assert head + flat(b) == full


def test_distributed_sampler_epoch_is_not_overwritten():
    ds = Items(16)
    orders = []
    for cls in (DataLoader, TorchDL):
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(5)
        orders.append(flat(cls(ds, batch_size=8, sampler=sampler)))
    zero = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=0)
    assert orders[0] == orders[1] != flat(TorchDL(ds, batch_size=8, sampler=zero))


@pytest.mark.parametrize("workers", [0, 2])
def test_two_iterators_are_independent_like_torch(workers):
    got = []
    for cls in (DataLoader, TorchDL):
        dl = cls(Items(), batch_size=2, num_workers=workers)
        first = iter(dl)
        head = next(first).tolist()
        second = flat(iter(dl))
        got.append((head, [b.tolist() for b in first], second))
        del first
    assert got[0] == got[1] == ([0, 1], [[2, 3], [4, 5], [6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]])


def test_persistent_workers_second_iter_resets_like_torch():
    got = []
    for cls in (DataLoader, TorchDL):
        dl = cls(Items(), batch_size=2, num_workers=1, persistent_workers=True)
        first = iter(dl)
        next(first)
        got.append(flat(dl))  # torch reuses (resets) the one iterator: a full fresh pass
        got.append(flat(dl))
        dl._iterator._shutdown_workers()
    assert got[0] == got[1] == got[2] == got[3] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_abandoned_iterator_leaves_no_worker():
    dl = DataLoader(Items(), batch_size=1, num_workers=2)
    for b in dl:
        break
    del b
    gc.collect()
    assert multiprocessing.active_children() == [] or _wait_children()
    it = iter(DataLoader(Items(), batch_size=1, num_workers=2, device="cpu"))
    next(it)
    del it
    gc.collect()
    assert _wait_children()


def _wait_children(timeout=15.0):
    import time
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return multiprocessing.active_children() == []


def test_iterable_reported_length_warning_is_kept():
    for cls in (DataLoader, TorchDL):
        dl = cls(Stream(n=6, reported=3), batch_size=None)
        assert len(dl) == 3
        with pytest.warns(UserWarning, match="reported to be 3"):
            flat(dl)


# ---------------------------------------------------------------- samplers and options -----------------

@pytest.mark.parametrize("kw", [
    dict(sampler=SequentialSampler(range(8)), batch_size=3),
    dict(sampler=RandomSampler(range(8), generator=torch.Generator().manual_seed(1)), batch_size=3),
    dict(batch_sampler=BatchSampler(SequentialSampler(range(8)), 3, drop_last=True)),
    dict(batch_size=None),
    dict(batch_size=3, drop_last=True, num_workers=2, in_order=False),
    dict(batch_size=3, num_workers=2, prefetch_factor=1, timeout=30),
    dict(batch_size=3, pin_memory=True, pin_memory_device="cpu"),
])
def test_samplers_and_options_same_batches(kw):
    if "generator" in repr(kw.get("sampler")) or isinstance(kw.get("sampler"), RandomSampler):
        kw["sampler"].generator.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator warns in both
        ours = flat(DataLoader(Items(), **kw))
        if isinstance(kw.get("sampler"), RandomSampler):
            kw["sampler"].generator.manual_seed(1)
        theirs = flat(TorchDL(Items(), **kw))
    if kw.get("in_order") is False:
        ours, theirs = sorted(map(tuple, ours)), sorted(map(tuple, theirs))
    assert ours == theirs and ours


def _init(worker_id):
    torch.manual_seed(1000 + worker_id)


@pytest.mark.timeout(120)
def test_spawn_context_and_worker_init_fn():
    kw = dict(batch_size=None, num_workers=1, multiprocessing_context="spawn", worker_init_fn=_init)
    ours = flat(DataLoader(Noisy(), **kw))
    assert ours == flat(TorchDL(Noisy(), **kw))  # worker_init_fn seeded both the same way
    assert DataLoader(Items(), num_workers=1, multiprocessing_context="spawn").multiprocessing_context \
        .get_start_method() == "spawn"
    with pytest.raises(ValueError, match="multiprocessing_context"):
        DataLoader(Items(), multiprocessing_context="spawn")  # needs workers, as in torch
