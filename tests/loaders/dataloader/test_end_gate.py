"""loaders.DataLoader(device=): a pass left at any batch leaves the sampler's generator as torch's DataLoader leaves
it, so the next pass's order is torch's (:mod:`loaders.dataloader.end_gate`). torch 2.13's ``RandomSampler`` draws
once more as it runs out (a second ``randperm``), in the pull that looks past its end; the prefetch thread runs
torch's iterator ahead of the consumer and must not make that pull before torch would."""
import time

import pytest
import torch
import torch.utils.data as tud

from loaders import DataLoader

B = 4


def left_then_whole(make, k: int) -> list:
    """A loader made by ``make()``: a pass left after ``k`` batches (as ``for b in loader: ... break`` leaves it),
    then a whole pass, whose batches are returned."""
    dl = make()
    it = iter(dl)
    for _ in range(k):
        next(it)
    del it
    out = [b.cpu().clone() for b in dl]
    if hasattr(dl, "close"):
        dl.close()
    return out


def differ(make_ours, make_torchs, positions) -> list:
    """The positions ``k`` (batches taken before the pass is left) whose next pass differs from torch's."""
    bad = []
    for k in positions:
        a, b = left_then_whole(make_ours, k), left_then_whole(make_torchs, k)
        if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
            bad.append(k)
    return bad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("samples", [40, 38])  # 10 batches: the last one whole (the extra draw after it) or short
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_the_pass_after_one_left_at_any_batch_is_torchs(samples, workers, persistent, device):
    ds = list(range(samples))
    kw = dict(batch_size=B, shuffle=True, num_workers=workers, persistent_workers=persistent)
    ours = lambda: DataLoader(ds, generator=torch.Generator().manual_seed(7), device=device, **kw)  # noqa: E731
    torchs = lambda: tud.DataLoader(ds, generator=torch.Generator().manual_seed(7), **kw)  # noqa: E731
    assert differ(ours, torchs, range(len(torchs()) + 1)) == []


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_any_prefetch_depth_and_drop_last_too(depth, drop_last):
    ds = list(range(38))
    kw = dict(batch_size=B, shuffle=True, num_workers=2, drop_last=drop_last)
    ours = lambda: DataLoader(ds, generator=torch.Generator().manual_seed(3), device="cpu",  # noqa: E731
                              prefetch_depth=depth, **kw)
    torchs = lambda: tud.DataLoader(ds, generator=torch.Generator().manual_seed(3), **kw)  # noqa: E731
    assert differ(ours, torchs, range(len(torchs()) - 5, len(torchs()) + 1)) == []


@pytest.mark.parametrize("samples", [40, 38])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_kept_while_another_runs_draws_its_end_where_torchs_does(workers, samples):
    """``k`` batches of one iterator, a whole pass of a second, the rest of the first, then another pass: torch's
    draws in torch's order (the first iterator's thread waited at its end pull meanwhile)."""
    ds = list(range(samples))
    kw = dict(batch_size=B, shuffle=True, num_workers=workers)

    def run(dl, k):
        first = iter(dl)
        for _ in range(k):
            next(first)
        time.sleep(0.02)  # its thread runs as far ahead as it may
        out = [b.clone() for b in dl] + [b.clone() for b in first] + [b.clone() for b in dl]
        return out

    bad = []
    for k in range(1, 11):
        got = run(DataLoader(ds, generator=torch.Generator().manual_seed(1), device="cpu", **kw), k)
        want = run(tud.DataLoader(ds, generator=torch.Generator().manual_seed(1), **kw), k)
        if len(got) != len(want) or not all(torch.equal(x, y) for x, y in zip(got, want)):
            bad.append(k)
    assert bad == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_left_near_its_end_is_followed_by_torchs_next_pass(workers):
    """A state taken 2 batches into a pass, resumed by another loader whose pass is left at batch ``k`` of the
    epoch: the pass after it is that of torch's run left at batch ``k``."""
    ds = list(range(38))
    kw = dict(batch_size=B, shuffle=True, num_workers=workers)
    dl = DataLoader(ds, generator=torch.Generator().manual_seed(3), device="cpu", **kw)
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    del it
    dl.close()
    n = len(dl)
    bad = []
    for k in range(n - 4, n + 1):
        def resumed():
            again = DataLoader(ds, generator=torch.Generator().manual_seed(99), device="cpu", **kw)
            again.load_state_dict(state)
            return again
        got = left_then_whole(resumed, k - 2)
        want = left_then_whole(lambda: tud.DataLoader(ds, generator=torch.Generator().manual_seed(3), **kw), k)
        if len(got) != len(want) or not all(torch.equal(x, y) for x, y in zip(got, want)):
            bad.append(k)
    assert bad == []


@pytest.mark.parametrize("sampler", ["shuffle", "replacement"])
def test_a_resumed_pass_left_before_its_first_next_draws_nothing_torch_had_not(sampler):
    """Without workers a resumed pass makes its first pull as it is made, past the batches it skips: where that pull
    draws (the end pull of a state taken after the last batch, or a ``replacement=True`` draw every 4 batches of 8),
    a pass left before its first ``next()`` puts the draw back, as torch's run left at that batch never made it."""
    if sampler == "shuffle":
        ds, positions = list(range(38)), range(1, 11)

        def make(cls, **extra):
            return cls(ds, batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(3), **extra)
    else:
        ds, positions = list(range(80)), range(1, 11)  # batches of 8: draws in pulls 1, 5 and 9

        def make(cls, **extra):
            g = torch.Generator().manual_seed(5)
            return cls(ds, batch_size=8, sampler=tud.RandomSampler(ds, replacement=True, generator=g), generator=g,
                       **extra)

    def resumed_left_unread(k):
        dl = make(DataLoader, device="cpu")
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        del it
        dl.close()
        again = make(DataLoader, device="cpu")
        again.load_state_dict(state)
        it = iter(again)
        del it
        out = [b.clone() for b in again]
        again.close()
        return out

    bad = []
    for k in positions:
        got, want = resumed_left_unread(k), left_then_whole(lambda: make(tud.DataLoader), k)
        if len(got) != len(want) or not all(torch.equal(x, y) for x, y in zip(got, want)):
            bad.append(k)
    assert bad == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_with_replacement_drawing_as_it_goes_is_rewound_to_torchs_draws(workers):
    """``RandomSampler(replacement=True)`` draws every 32 samples: the draws of pulls torch had not made when the pass
    was left are taken back."""
    ds = list(range(80))  # batches of 8: draws in pulls 1, 5 and 9

    def make(cls, **extra):
        def made():
            g = torch.Generator().manual_seed(5)
            sampler = tud.RandomSampler(ds, replacement=True, generator=g)
            return cls(ds, batch_size=8, sampler=sampler, generator=g, num_workers=workers, **extra)
        return made

    assert differ(make(DataLoader, device="cpu", prefetch_depth=3), make(tud.DataLoader), range(11)) == []


@pytest.mark.parametrize("persistent", [False, True])
def test_our_pin_thread_in_torchs_place_leaves_the_generator_as_torch_does(monkeypatch, persistent):
    """``pin_memory=True`` with workers: a thread of ours pins ahead of the consumer (faked pinning here)."""
    from tests.loaders.dataloader.test_loader import _fake_pinning

    _fake_pinning(monkeypatch)
    ds = list(range(38))
    kw = dict(batch_size=B, shuffle=True, num_workers=2, persistent_workers=persistent)
    ours = lambda: DataLoader(ds, generator=torch.Generator().manual_seed(2), pin_memory=True, **kw)  # noqa: E731
    torchs = lambda: tud.DataLoader(ds, generator=torch.Generator().manual_seed(2), **kw)  # noqa: E731
    assert differ(ours, torchs, range(4, 11)) == []


def test_a_thread_far_ahead_when_the_pass_is_left_still_leaves_torchs_draws():
    """The consumer steps slowly, so the thread is as far ahead as it goes each time the pass is left."""
    ds = list(range(40))
    kw = dict(batch_size=B, shuffle=True, num_workers=2)

    def slow(k):
        dl = DataLoader(ds, generator=torch.Generator().manual_seed(4), device="cpu", prefetch_depth=4, **kw)
        it = iter(dl)
        for _ in range(k):
            next(it)
            time.sleep(0.03)
        del it
        return [b.clone() for b in dl]

    for k in range(3, 11):
        want = left_then_whole(lambda: tud.DataLoader(ds, generator=torch.Generator().manual_seed(4), **kw), k)
        got = slow(k)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), k


@pytest.mark.parametrize("workers,samples", [(0, 40), (0, 38), (2, 40), (2, 38)])
def test_the_held_pull_costs_the_consumer_one_wait_a_pass_at_most(workers, samples):
    """A consumer slower than the loader: of a pass's pulls, the end pull alone waits for it (so the consumer waits
    for one batch a pass at most beyond torch's own), and it does wait, but for a pass whose thread fell behind
    (a gate on every pull would hold ~10 a pass)."""
    dl = DataLoader(list(range(samples)), batch_size=B, shuffle=True, num_workers=workers, device="cpu",
                    generator=torch.Generator().manual_seed(0))
    held = []
    for _ in range(4):
        it = iter(dl)
        for _ in it:
            time.sleep(0.02)
        held.append(it._p.gate.held)
    assert max(held) <= 1 and sum(held) >= 3, held
    dl.close()
