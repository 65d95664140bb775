"""loaders.DataLoader's stats() (loaders/dataloader/stats.py)."""
import pytest
import torch

from loaders import DataLoader
from tests.loaders.toy_datasets import N, Squares, run


def test_stats_counts():
    dl = DataLoader(Squares(), batch_size=4, device="cpu")
    assert dl.stats()["batches"] == 0
    n = len(run(dl))
    s = dl.stats()
    assert s["batches"] == n and s["samples"] == N
    assert s["elapsed_s"] > 0 and 0.0 <= s["wait_fraction"] <= 1.0 and s["wait_s"] <= s["elapsed_s"]
    assert s["samples_per_s"] == pytest.approx(N / s["elapsed_s"])
    assert {"autotune", "num_workers", "prefetch_depth", "batches_per_s"} <= set(s)
    assert s["producer"]["batches"] == n  # the prefetch thread's CPU time, per batch it made


@pytest.mark.parametrize("collate, expected", [
    (lambda b: (list(range(len(b))), [torch.zeros(3, 4, 4) for _ in b], list(b)), 5),  # columns of lists
    (lambda b: [(torch.zeros(3, 4, 4), i) for i in b], 5),  # a list of samples holding tensors
    (lambda b: {"__key__": [str(i) for i in b], "x": [torch.zeros(3) for _ in b]}, 5),
    (None, 5),  # default_collate: stacked tensors
])
def test_samples_are_counted_whatever_the_batch_layout(collate, expected):
    dl = DataLoader(list(range(10)), batch_size=5, collate_fn=collate)
    batches = sum(1 for _ in dl)
    assert dl.stats()["samples"] == batches * expected
