"""loaders.dataloader.tuning: the choices of num_workers="auto" and prefetch_depth="auto"."""
import types

import pytest
import torch

from loaders.dataloader.tuning import check_options, retune, workers_for_iterable, workers_from_first_batches


def _stats(**kw):
    base = dict(consume_s=0.0, consume_n=0, batch_bytes=0, started=0.0, ended=10.0, yielded=100, wait_s=0.0)
    return types.SimpleNamespace(**{**base, **kw})


def test_options_a_loader_cannot_take_are_refused():
    check_options(num_workers="auto", prefetch_depth="auto", max_workers=None)
    for kw, name, error in [(dict(num_workers=True), "num_workers", TypeError),
                            (dict(prefetch_depth=0), "prefetch_depth", ValueError),
                            (dict(max_workers=0), "max_workers", ValueError)]:
        with pytest.raises(error, match=name):
            check_options(**{"num_workers": 0, "prefetch_depth": 2, "max_workers": None, **kw})
    check_options(num_workers=-1, prefetch_depth=2, max_workers=None)  # torch's own check raises, in its words


def test_slow_production_asks_for_more_workers_than_fast():
    slow = workers_from_first_batches([0.5, 0.2, 0.2], _stats(consume_s=0.1, consume_n=10), prefetch_factor=2,
                                      max_workers=64)
    fast = workers_from_first_batches([0.5, 0.001, 0.001], _stats(consume_s=0.1, consume_n=10), prefetch_factor=2,
                                      max_workers=64)
    assert slow["value"] >= fast["value"] >= 1


def test_an_iterable_dataset_starts_at_the_bound_and_says_why():
    d = workers_for_iterable(max_workers=3)
    assert 1 <= d["value"] <= 3 and d["reason"].startswith("iterable dataset")


def test_retune_chooses_a_depth_only_when_asked_and_the_batch_size_is_known():
    choice, res = retune(_stats(wait_s=8.0), workers=2, workers_hi=8, depth=2, depth_hi=8, tune_depth=False)
    assert choice is None and res["prefetch_depth"] is None and res["num_workers"] > 2  # waited 80%: grow
    choice, res = retune(_stats(batch_bytes=1 << 20), workers=None, workers_hi=1, depth=2, depth_hi=8,
                         tune_depth=True)
    assert choice is not None and res["num_workers"] is None


@pytest.mark.parametrize("before, after", [(0, 2), (2, 0), (2, 1)])
def test_a_worker_count_set_on_a_built_loader_serves_its_next_pass_as_in_torch(before, after):
    from loaders import DataLoader

    class WhoReads(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            info = torch.utils.data.get_worker_info()
            return -1 if info is None else info.id

    dl = DataLoader(WhoReads(), batch_size=2, num_workers=before)
    assert len({int(x) for b in dl for x in b}) == max(1, before)
    dl.num_workers = after
    assert len({int(x) for b in dl for x in b}) == max(1, after)
    assert dl.stats()["num_workers"] == after
    if before:  # torch's own, for comparison (from 0 workers it fails: its prefetch_factor stays None)
        theirs = torch.utils.data.DataLoader(WhoReads(), batch_size=2, num_workers=before)
        theirs.num_workers = after
        assert len({int(x) for b in theirs for x in b}) == max(1, after)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), ("auto", TypeError), (1.5, TypeError)])
def test_a_bad_worker_count_set_on_a_built_loader_is_refused_at_the_next_pass(bad, error):
    from loaders import DataLoader

    dl = DataLoader(list(range(4)), batch_size=2)
    dl.num_workers = bad
    with pytest.raises(error):
        iter(dl)
