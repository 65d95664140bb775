"""bench/prefetch.py's timed loop: rate, wait and the step's own time per step."""
import torch

from bench.prefetch import cached, train


def test_train_reports_the_steps_own_time_apart_from_the_wait():
    calls = []
    batch = (torch.zeros(2, 3), None)
    out = train(cached(batch), calls.append, torch.device("cpu"), steps=7, warmup=3, move=False)
    assert len(calls) == 10  # warm-up steps run too, untimed
    assert out["step_p50_ms"] <= out["step_p90_ms"] <= out["step_p99_ms"]
    assert 0 <= out["wait_fraction"] <= 1 and out["steps_per_s"] > 0
