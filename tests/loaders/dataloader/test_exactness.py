"""loaders.DataLoader: every batch exact in every way torch lets users hold and iterate a loader (issue #45):
live iterators side by side in any order, persistent or not; batches held for whole passes, pickled,
``torch.save``d, sent to another process, written in place. Each value is checked against what the dataset made."""
import io
import pickle
import random

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import Dataset, default_collate

from loaders import DataLoader
from tests.loaders.dataloader.test_loader import _fake_pinning

N, B = 96, 8  # 12 batches


class Stamped(Dataset):
    """Sample i: bytes, a numpy array and tensors of three dtypes, every value derived from i."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"key": f"k{i:06d}".encode() * 300, "arr": np.full(700, i, np.int32),
                "img": torch.full((3, 16, 16), float(i)), "ids": torch.full((40,), i, dtype=torch.int64),
                "mask": torch.full((24,), i % 2 == 0)}


def samples(collate):
    """collate_fn: the list of samples itself."""
    return list(collate)


def nested(batch):
    """collate_fn: a dict of lists of the samples' leaves, the tensors in a nested dict."""
    return {"key": [s["key"] for s in batch], "arr": [s["arr"] for s in batch],
            "t": {"img": [s["img"] for s in batch], "ids": [s["ids"] for s in batch],
                  "mask": [s["mask"] for s in batch]}}


COLLATES = {"samples": samples, "nested": nested, "default": default_collate}


def wrong(batch, n: int) -> int:
    """How many values of batch ``n`` (samples n*B ...) differ from the dataset's, whatever the collate."""
    bad = 0
    if isinstance(batch, list):
        batch = nested(batch)
    for j in range(B):
        i = n * B + j
        key = batch["key"][j]
        arr = batch["arr"][j]
        tensors = batch["t"] if "t" in batch else batch
        bad += key != f"k{i:06d}".encode() * 300
        bad += not bool((torch.as_tensor(np.asarray(arr)) == i).all())
        bad += not bool((tensors["img"][j] == float(i)).all())
        bad += not bool((tensors["ids"][j] == i).all())
        bad += not bool((tensors["mask"][j] == (i % 2 == 0)).all())
    return bad


def loader(where, monkeypatch, **kw):
    """A loader of ``Stamped`` with two workers, its batches delivered as ``where`` says: ``None`` (torch's
    way), ``cpu`` (our prefetch thread) or ``pin`` (our pin thread, with a copy standing in for pinning)."""
    if where == "pin":
        _fake_pinning(monkeypatch)
        kw["pin_memory"] = True
    elif where == "cpu":
        kw["device"] = "cpu"
    kw.setdefault("collate_fn", samples)
    return DataLoader(Stamped(), batch_size=B, num_workers=2, **kw)


@pytest.mark.parametrize("where", [None, "cpu", "pin"])
@pytest.mark.parametrize("collate", ["samples", "nested"])
def test_a_whole_pass_run_while_an_earlier_iterator_is_live_leaves_both_exact(monkeypatch, where, collate):
    """The issue's case: 3 batches of it1, a whole ``for`` pass, then the rest of it1; every batch held."""
    dl = loader(where, monkeypatch, collate_fn=COLLATES[collate])
    it1 = iter(dl)
    first = [next(it1) for _ in range(3)]
    received = [wrong(b, n) for n, b in enumerate(first)]
    second = []
    for n, b in enumerate(dl):
        received.append(wrong(b, n))
        second.append(b)
    rest = list(it1)
    received += [wrong(b, n) for n, b in enumerate(rest, 3)]
    assert len(first + rest) == len(second) == N // B
    assert sum(received) == 0  # exact on receipt
    assert sum(wrong(b, n) for n, b in [*enumerate(first + rest), *enumerate(second)]) == 0  # and still, held
    dl.close()


@pytest.mark.parametrize("where", [None, "cpu", "pin"])
@pytest.mark.parametrize("seed", [0, 1])
def test_three_live_iterators_interleaved_in_any_order_each_exact_and_whole(monkeypatch, where, seed):
    dl = loader(where, monkeypatch)
    its, got, live = [], [], []
    order = random.Random(seed)
    while live or len(its) < 3:
        if len(its) < 3 and (not live or order.random() < 0.15):  # the next one starts while others run
            its.append(iter(dl))
            got.append([])
            live.append(len(its) - 1)
        k = order.choice(live)
        try:
            got[k].append(next(its[k]))
        except StopIteration:
            live.remove(k)
    assert [len(g) for g in got] == [N // B] * 3
    assert sum(wrong(b, n) for g in got for n, b in enumerate(g)) == 0
    dl.close()


@pytest.mark.parametrize("where", [None, "cpu", "pin"])
def test_persistent_workers_one_live_pass_the_superseded_one_ends_and_every_held_batch_stays_exact(monkeypatch,
                                                                                                  where):
    dl = loader(where, monkeypatch, persistent_workers=True)
    held = []
    for _ in range(3):
        it1 = iter(dl)
        held += [(n, next(it1)) for n in range(2)]
        it2 = iter(dl)  # torch: the one iterator of persistent workers is reset; ours: it1 ends here
        held += [(n, next(it2)) for n in range(4)]
        with pytest.raises(StopIteration):
            next(it1)
        held += list(enumerate(it2, 4))
    held += list(enumerate(dl))  # a whole pass after three left half-done
    assert sum(wrong(b, n) for n, b in held) == 0 and len(held) == 3 * (2 + N // B) + N // B
    dl.close()


@pytest.mark.parametrize("where", [None, "pin"])
def test_batches_written_in_place_change_no_other_batch(monkeypatch, where):
    dl = loader(where, monkeypatch)
    held = []
    for epoch in range(2):
        for n, b in enumerate(dl):
            for s in b:  # the user's own memory: writing into it touches nothing else
                s["img"].add_(1000.0)
                s["arr"][:] = -1
            held.append((n, b))
    for n, b in held:
        for j, s in enumerate(b):
            i = n * B + j
            assert bool((s["img"] == i + 1000.0).all()) and bool((s["arr"] == -1).all())
            assert bool((s["ids"] == i).all()) and s["key"] == f"k{i:06d}".encode() * 300
    dl.close()


def _own_bytes(batch) -> int:
    total = 0
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
        elif isinstance(leaf, bytes):
            total += len(leaf)
    return total


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class Images(Dataset):
    """The issue's size case: 3x64x64 float images (48 KB each) and an int label."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 64, 64), float(i)), i


@pytest.mark.parametrize("collate", ["samples", "nested", "default"])
def test_a_batch_saves_and_pickles_as_torchs_does_and_loads_back_equal(collate):
    kw = dict(batch_size=B, num_workers=2, collate_fn=COLLATES[collate])
    dl = DataLoader(Stamped(), **kw)
    batches = list(dl)
    theirs = list(torch.utils.data.DataLoader(Stamped(), **kw))
    for n, (b, t) in enumerate(zip(batches, theirs)):
        saved, pickled = _saved(b), pickle.dumps(b)
        # torch's batch: each leaf its own bytes, plus a few hundred bytes of framing a tensor (24 small ones here)
        assert len(saved) <= 1.05 * len(_saved(t)) and len(pickled) <= 1.05 * len(pickle.dumps(t))
        assert len(saved) <= 1.2 * _own_bytes(b) and len(pickled) <= 1.2 * _own_bytes(b)
        assert wrong(torch.load(io.BytesIO(saved), weights_only=False), n) == 0
        assert wrong(pickle.loads(pickled), n) == 0
    dl.close()


def test_a_batch_of_image_lists_and_one_tensor_of_it_save_at_their_own_size():
    dl = DataLoader(Images(), batch_size=32, num_workers=2, collate_fn=samples)
    for b in dl:
        own = sum(img.numel() * img.element_size() for img, _ in b)
        assert len(pickle.dumps(b)) <= 1.1 * own and len(_saved(b)) <= 1.1 * own
        one = b[3][0]
        assert len(_saved(one)) <= 1.1 * one.numel() * one.element_size()
        assert len(pickle.dumps(one)) <= 1.1 * one.numel() * one.element_size()
    dl.close()


def _check_in_child(queue, results):
    bad = 0
    for n in range(N // B):
        bad += wrong(queue.get(), n)
    results.put(bad)


@pytest.mark.parametrize("collate", ["samples", "nested"])
def test_batches_sent_to_another_process_arrive_exact(collate):
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_check_in_child, args=(queue, results))
    child.start()
    dl = DataLoader(Stamped(), batch_size=B, num_workers=2, collate_fn=COLLATES[collate])
    held = []
    for b in dl:
        queue.put(b)
        held.append(b)
    assert results.get(timeout=120) == 0
    child.join(30)
    assert sum(wrong(b, n) for n, b in enumerate(held)) == 0
    dl.close()


# ---------------------------------------------------------------- GPU -------------------------------

def gpu_loader(where, **kw):
    """``where``: ``cuda`` (the loader copies to the GPU, from registered segments in place) or ``pin`` (torch's
    idiom: ``pin_memory=True``, pinned in our thread, the loop moves the batch)."""
    kw.setdefault("collate_fn", samples)
    extra = dict(device="cuda") if where == "cuda" else dict(pin_memory=True)
    return DataLoader(Stamped(), batch_size=B, num_workers=2, **extra, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cuda", "pin"])
@pytest.mark.parametrize("collate", ["samples", "nested"])
def test_gpu_a_whole_pass_run_while_an_earlier_iterator_is_live_leaves_both_exact(where, collate):
    dl = gpu_loader(where, collate_fn=COLLATES[collate])
    it1 = iter(dl)
    first = [next(it1) for _ in range(3)]
    second = list(dl)
    rest = list(it1)
    assert len(first + rest) == len(second) == N // B
    torch.cuda.synchronize()
    assert sum(wrong(b, n) for n, b in [*enumerate(first + rest), *enumerate(second)]) == 0
    dl.close()


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cuda", "pin"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_three_live_iterators_interleaved_each_exact_and_whole(where, seed):
    dl = gpu_loader(where)
    its, got, live = [], [], []
    order = random.Random(seed)
    while live or len(its) < 3:
        if len(its) < 3 and (not live or order.random() < 0.15):
            its.append(iter(dl))
            got.append([])
            live.append(len(its) - 1)
        k = order.choice(live)
        try:
            got[k].append(next(its[k]))
        except StopIteration:
            live.remove(k)
    assert [len(g) for g in got] == [N // B] * 3
    assert sum(wrong(b, n) for g in got for n, b in enumerate(g)) == 0
    dl.close()


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cuda", "pin"])
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_batches_held_for_epochs_stay_exact(where, persistent):
    dl = gpu_loader(where, persistent_workers=persistent, collate_fn=nested)
    held = []
    for _ in range(4):
        it = iter(dl)
        held += [(n, next(it)) for n in range(3)]  # a pass left unfinished: its segments in flight
        held += list(enumerate(dl))
    torch.cuda.synchronize()
    assert sum(wrong(b, n) for n, b in held) == 0
    for n, b in held[:6]:  # and they save and pickle as their own bytes
        assert wrong(torch.load(io.BytesIO(_saved(b)), weights_only=False), n) == 0
        assert wrong(pickle.loads(pickle.dumps(b)), n) == 0
    dl.close()


@pytest.mark.gpu
def test_gpu_a_killed_worker_is_torchs_error_with_device_cuda(tmp_path):
    from tests.loaders.dataloader import test_deaths as d

    dl = DataLoader(d.Stamped(), batch_size=8, num_workers=2, collate_fn=samples, device="cuda",
                    worker_init_fn=d.functools.partial(d._note_pid, str(tmp_path)))
    _, it, n = d._run_until_a_worker_dies(dl, tmp_path, d._check_stamped)
    d._the_pass_ends(it, n, d._check_stamped)
    dl.close()
    assert [p for p in d._pids(tmp_path) if not d._gone(p)] == []
