"""bench/launch_stalls.py: the figures it reports from launch-call times (the GPU run itself is on the device)."""
import threading

import pytest
import torch

from bench.launch_stalls import ACTIVITIES, activity, driver_launch_times, spread


def test_spread_counts_calls_over_the_thresholds_per_10k():
    times = [5e-6] * 9_997 + [3e-4, 2e-3, 5e-3]
    s = spread("call", times)
    assert s["call_n"] == 10_000 and s["call_p50_us"] == 5.0
    assert s["call_over_0.2ms_per_10k"] == 3 and s["call_over_1ms_per_10k"] == 2 and s["call_max_ms"] == 5.0
    assert spread("driver", []) == {"driver_n": 0}


def test_driver_launch_times_keep_the_timed_threads_launches_only():
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            x.add_(1)
    assert driver_launch_times(prof) == []  # no CUDA here: no launch calls, but the thread was found


@pytest.mark.parametrize("name", ["none", "shm_free", "anon_free"])
def test_cpu_activities_run_until_stopped(name):
    stop = threading.Event()
    runs = 0
    for _ in activity(name, stop, None):
        runs += 1
        if runs == 2:
            stop.set()
    assert runs == (0 if name == "none" else 2)
    assert name in ACTIVITIES
