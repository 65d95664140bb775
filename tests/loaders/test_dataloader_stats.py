"""loaders.DataLoader's stats() (loaders/dataloader_stats.py)."""
import pytest

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
