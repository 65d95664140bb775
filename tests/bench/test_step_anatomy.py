"""bench/step_anatomy.py's trace analysis, on a hand-made trace (the profiling itself needs a GPU)."""
import pytest

from bench.step_anatomy import NEXT, STEP, analyse, reference_kernels


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace(kernel_durs, loader=None, train_tid=1, slow_api=0):
    """Steps of 100 us: next() 10 us, then one launch per kernel on the training thread (stream 7).

    ``loader``: (start, duration) of kernels a thread 7 launched on stream 20, each after a 40 us cudaFree.
    """
    events, corr = [], 0
    for i, durs in enumerate(kernel_durs):
        t = 1000 * i
        events += [_x(STEP, "user_annotation", t, 100, train_tid), _x(NEXT, "user_annotation", t, 10, train_tid)]
        if slow_api:
            events.append(_x("cudaStreamWaitEvent", "cuda_runtime", t + 1, slow_api, train_tid, correlation=-1))
        start = t + 20
        for k, d in enumerate(durs):
            corr += 1
            events.append(_x("cudaLaunchKernel", "cuda_runtime", t + 11 + k, 1, train_tid, correlation=corr))
            events.append(_x(f"k{k}", "kernel", start, d, 99, correlation=corr, stream=7))
            start += d
    for ts, dur in loader or []:
        corr += 1
        events.append(_x("cudaLaunchKernel", "cuda_runtime", ts - 5, 2, 7, correlation=corr))
        events.append(_x("dali_kernel", "kernel", ts, dur, 98, correlation=corr, stream=20))
        events.append(_x("cudaFree", "cuda_runtime", ts - 3, 40, 7, correlation=corr + 10**6))
    return events


def test_splits_the_step_into_busy_idle_and_next():
    r = analyse(_trace([[30, 20]] * 3))
    assert r["steps"] == 3
    assert r["step_ms"] == pytest.approx(0.1)
    assert r["train_busy_ms"] == pytest.approx(0.05)
    assert r["train_idle_ms"] == pytest.approx(0.05)
    assert r["first_kernel_ms"] == pytest.approx(0.02)
    assert r["next_ms"] == pytest.approx(0.01)
    assert r["loader_kernel_ms"] == 0
    # idle: 20 us before the first kernel, 50 us after the last, none between
    assert r["idle_start_ms"] == pytest.approx(0.02)
    assert r["idle_end_ms"] == pytest.approx(0.03)
    assert r["idle_q1_ms"] == r["idle_q2_ms"] == 0


def test_idle_between_kernels_is_placed_in_the_quarter_of_the_step_it_starts_in():
    from bench.step_anatomy import _idle_by_phase

    out = _idle_by_phase([(10, 20), (30, 40), (80, 90)], 0, 100)
    assert out == pytest.approx({"start": 0.01, "q1": 0.01, "q2": 0.04, "q3": 0, "q4": 0, "end": 0.01})


def test_loader_kernels_are_those_off_the_training_streams_and_slowdown_splits_by_overlap():
    ref = reference_kernels(analyse(_trace([[30, 20]] * 3)))
    # each step: k0 took 40 (10 more) while a loader kernel ran beside it; k1 took 25 (5 more) alone
    loaded = _trace([[40, 25]] * 3, loader=[(1000 * i + 25, 10) for i in range(3)])
    r = analyse(loaded, ref)
    assert r["loader_kernel_ms"] == pytest.approx(0.01)
    assert r["loader_overlap_ms"] == pytest.approx(0.01)
    assert r["slowdown_overlapped_ms"] == pytest.approx(0.01)
    assert r["slowdown_alone_ms"] == pytest.approx(0.005)
    assert r["loader_top"][0][0] == "dali_kernel"
    assert r["other_api"]["cudaFree"]["max_ms"] == pytest.approx(0.04)
    assert "cudaFree" not in r["train_api"]
    assert r["syncing_calls"]["cudaFree @ 7"]["calls_per_step"] == 1


def test_kernels_another_thread_launches_on_the_training_stream_are_the_trainings():
    """autograd's backward thread launches on the training stream: its kernels are no loader's."""
    events = _trace([[30, 20]] * 2)
    for e in events:
        if e["cat"] == "cuda_runtime" and e["name"] == "cudaLaunchKernel" and e["args"]["correlation"] % 2 == 0:
            e["tid"] = 5  # the second kernel of each step launched by another thread
    r = analyse(events, threads={5: "autograd"})
    assert r["loader_kernel_ms"] == 0
    assert r["train_busy_ms"] == pytest.approx(0.05)
    assert "cudaLaunchKernel" not in r["other_api"]


def test_api_time_inside_next_is_reported_apart():
    r = analyse(_trace([[30]] * 2, slow_api=8))
    assert r["train_api_in_next"]["cudaStreamWaitEvent"]["ms_per_step"] == pytest.approx(0.008)
    assert "cudaLaunchKernel" not in r["train_api_in_next"]


def test_a_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="anatomy_step"):
        analyse([_x("k", "kernel", 0, 1, 99)])


def test_gaps_are_split_into_host_late_and_queued_and_blocked_launches_are_counted():
    ev = [_x(STEP, "user_annotation", 0, 400), _x(NEXT, "user_annotation", 0, 5)]
    # (kernel start, duration, launch call start, launch call duration)
    for corr, (ks, kd, ls, ld) in enumerate([(20, 30, 10, 1),      # A
                                             (120, 20, 90, 25),    # B: its launch returned at 115, A ended at 50
                                             (220, 20, 60, 1),     # C: launched long before, started 80 us late
                                             (250, 10, 241, 300)]):  # D: a launch call blocked 300 us
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", ls, ld, correlation=corr))
        ev.append(_x(f"k{corr}", "kernel", ks, kd, 99, correlation=corr, stream=7))
    r = analyse(ev)
    assert r["idle_host_late_ms"] == pytest.approx(0.07)  # A -> B
    assert r["idle_queued_ms"] == pytest.approx(0.08)  # B -> C; C -> D is 10 us, under the threshold
    assert r["blocked_launch_ms"] == pytest.approx(0.3)
