"""bench/prefetch.py's timed loop: rate, wait and the step's own time per step."""

import pytest
import torch

from bench.prefetch import replay as cached, train


def test_train_reports_the_steps_own_time_apart_from_the_wait():
    calls = []
    batch = (torch.zeros(2, 3), None)
    out = train(cached(batch), calls.append, torch.device("cpu"), steps=7, warmup=3, move=False)
    assert len(calls) == 10  # warm-up steps run too, untimed
    assert out["step_p50_ms"] <= out["step_p90_ms"] <= out["step_p99_ms"]
    assert 0 <= out["wait_fraction"] <= 1 and out["steps_per_s"] > 0


def test_the_cpu_loop_reports_no_gpu_timeline():
    out = train(cached((torch.zeros(2, 3), None)), lambda x: None, torch.device("cpu"), steps=3, warmup=1, move=False)
    assert not [k for k in out if k.startswith("gpu_")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_timeline_splits_the_step_into_busy_and_turnaround():
    from bench.prefetch import Step

    device = torch.device("cuda")
    step = Step(device, target_s=0.005, dim=1024)
    batch = (torch.zeros(4, 3, device=device), None)
    out = train(cached(batch), step, device, steps=20, warmup=3, move=False)
    period_ms = 1e3 / out["steps_per_s"]
    assert 0 < out["gpu_busy_p50_ms"] <= out["step_p90_ms"] + 0.5
    assert 0 <= out["gpu_turnaround_mean_ms"] < period_ms
    # busy + turnaround tile the period on the GPU: their means add up to it (within launch jitter)
    assert abs(out["gpu_busy_mean_ms"] + out["gpu_turnaround_mean_ms"] - period_ms) < 0.2 * period_ms


def test_quick_run_writes_every_loader_of_both_cases(tmp_path):
    from bench.prefetch import main

    res = main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    loaders = {(r["case"], r["loader"]) for r in res["training"]}
    assert loaders == {(c, l) for c in ("host keeps up", "host cannot keep up")
                       for l in ("torch DataLoader(pin_memory)", "loaders.DataLoader(device)",
                                 "loaders.DataLoader(pin_memory) + .to()")}
    assert all(r["ceiling_ratio"] > 0 for r in res["training"])
    assert (tmp_path / "prefetch.json").exists()
