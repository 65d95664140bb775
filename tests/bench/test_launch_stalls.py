"""bench/launch_stalls.py: the figures it reports from launch-call times (the GPU run itself is on the device)."""
import threading

import pytest
import torch

from bench.launch_stalls import ACTIVITIES, activity, api_records, split_launches, spread


def test_spread_counts_calls_over_the_thresholds_per_10k():
    times = [5e-6] * 9_997 + [3e-4, 2e-3, 5e-3]
    s = spread("call", times)
    assert s["call_n"] == 10_000 and s["call_p50_us"] == 5.0
    assert s["call_over_0.2ms_per_10k"] == 3 and s["call_over_1ms_per_10k"] == 2 and s["call_max_ms"] == 5.0
    assert spread("driver", []) == {"driver_n": 0}


def test_split_launches_tells_the_timed_threads_launches_by_time():
    records = [
        ("aten::add_", 0.0, 20.0), ("cudaLaunchKernel", 2.0, 10.0),
        ("aten::add_", 100.0, 3_200.0), ("cudaLaunchKernel", 101.0, 3_100.0),  # 3 ms: long
        ("cudaLaunchKernel", 50.0, 60.0),  # another thread's launch, between two timed ops
        ("cudaHostAlloc", 90.0, 3_000.0),  # another thread's call, across the long launch
        ("cudaEventRecord", 4_000.0, 4_010.0),
    ]
    out = split_launches(records)
    assert sorted(out["times"]) == [8e-6, 2.999e-3]
    assert out["ambiguous"] == 0 and out["long_launches"] == 1
    assert out["beside_long_launches"] == {"cudaHostAlloc": 1}
    assert out["other_calls"]["cudaLaunchKernel"] == {"n": 1, "ms": 0.01}
    assert set(out["other_calls"]) == {"cudaLaunchKernel", "cudaHostAlloc", "cudaEventRecord"}


def test_a_launch_inside_its_op_counts_even_when_the_profile_gave_it_another_parent():
    # another thread's long call began inside the op and ended after it: the profile's nesting popped
    # the op and hung the launch under that call
    records = [("aten::add_", 0.0, 3_000.0), ("cudaStreamSynchronize", 1.0, 5_000.0),
               ("cudaLaunchKernel", 2.0, 2_900.0)]
    out = split_launches(records)
    assert out["times"] == [2.898e-3] and out["long_launches"] == 1
    assert out["beside_long_launches"] == {"cudaStreamSynchronize": 1}


def test_split_launches_takes_an_ops_first_launch_when_another_threads_falls_inside_it():
    records = [("aten::add_", 0.0, 50.0), ("cudaLaunchKernel", 1.0, 5.0),
               ("cudaLaunchKernel", 10.0, 40.0)]
    out = split_launches(records)
    assert out["times"] == [4e-6] and out["ambiguous"] == 1
    assert out["other_calls"] == {"cudaLaunchKernel": {"n": 1, "ms": 0.03}}


def test_api_records_keep_the_timed_op_and_cuda_calls():
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            x.add_(1)
            x.mul_(1)
    records = api_records(prof)
    assert [r[0] for r in records] == ["aten::add_"] * 5  # no CUDA here: the timed ops only
    assert split_launches(records)["times"] == []


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
