"""datapipe.device.idle: the part of a wait in next() during which the consumer's GPU had nothing to run."""
import time

import pytest
import torch

from datapipe.device import idle as idle_module
from datapipe.device.idle import IdleTimer


class FakeEvent:
    """A timing event on a fake GPU clock: reached at ``gpu.free_at`` (when the queued work ends) or at once."""

    def __init__(self, gpu):
        self.gpu, self.at = gpu, None

    def record(self, stream):
        self.at = max(self.gpu.now, self.gpu.free_at)

    def query(self):
        return self.gpu.now >= self.at

    def synchronize(self):
        self.gpu.now = max(self.gpu.now, self.at)

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


@pytest.fixture
def fake_gpu(monkeypatch):
    clock = type("Gpu", (), {"now": 0.0, "free_at": 0.0})()
    monkeypatch.setattr(idle_module.torch.cuda, "Event", lambda enable_timing=False: FakeEvent(clock), raising=False)
    monkeypatch.setattr(idle_module, "CurrentStream", lambda device: lambda: "the consumer's stream")
    return clock


def test_a_wait_while_queued_steps_still_run_costs_the_gpu_nothing(fake_gpu):
    timer = IdleTimer(torch.device("cuda"))
    fake_gpu.free_at = 0.040  # a step queued until 40 ms
    timer.start()
    fake_gpu.now = 0.030  # the batch comes at 30 ms: the step still runs
    assert timer.idle_s(0.030) == 0.0


def test_only_the_end_of_a_wait_after_the_queued_step_finished_counts(fake_gpu):
    timer = IdleTimer(torch.device("cuda"))
    fake_gpu.free_at = 0.037  # CUDA graphs: the host asks right after launching a 37 ms step
    timer.start()
    fake_gpu.now = 0.040  # the batch comes 3 ms after the step finished
    assert timer.idle_s(0.040) == pytest.approx(0.003)


def test_a_loop_that_waited_for_the_gpu_first_starves_it_the_whole_wait(fake_gpu):
    timer = IdleTimer(torch.device("cuda"))
    fake_gpu.now = fake_gpu.free_at = 1.0  # nothing queued as the wait begins
    timer.start()
    fake_gpu.now = 1.025
    assert timer.idle_s(0.025) == pytest.approx(0.025)
    assert timer.idle_s(0.5) == 0.5  # no start(): nothing to tell, the whole wait


@pytest.mark.gpu
def test_gpu_idle_time_is_the_wait_after_the_queued_work():
    timer = IdleTimer(torch.device("cuda"))
    torch.cuda._sleep(1_000_000)  # warm the kernel up
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # tens of ms on the consumer's stream
    timer.start()
    assert timer.idle_s(0.001) == 0.0  # asked at once: the GPU still sleeps
    torch.cuda.synchronize()
    timer.start()  # the stream is idle: every moment of the wait is idle
    time.sleep(0.05)
    assert 0.04 < timer.idle_s(0.05) <= 0.05
    torch.cuda._sleep(20_000_000)  # ~10 ms of work, then a 100 ms wait
    timer.start()
    time.sleep(0.1)
    idle = timer.idle_s(0.1)
    assert 0.05 < idle < 0.1
