"""datapipe.device.queues: the hardware queues CUDA gives the process, and StepHold."""
import pytest
import torch

from datapipe.device import queues as queues_module
from datapipe.device.queues import DEFAULT_QUEUES, WIDE_QUEUES, StepHold, hardware_queues


@pytest.mark.parametrize("value, queues", [(None, DEFAULT_QUEUES), ("", DEFAULT_QUEUES), ("32", 32), (" 16 ", 16),
                                           ("1", 1), ("0", DEFAULT_QUEUES), ("many", DEFAULT_QUEUES)])
def test_hardware_queues_reads_what_cuda_reads(monkeypatch, value, queues):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    assert hardware_queues() == queues


def test_hardware_queues_are_what_the_variable_was_when_cuda_started(monkeypatch):
    started: list = []
    monkeypatch.setattr(torch.cuda, "_lazy_call", started.append)  # CUDA starts when the test says so
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    queues_module.watch_cuda_start()
    queues_module.watch_cuda_start()  # once is enough
    assert len(started) == 1
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts: CUDA will read 32
    assert hardware_queues() == 32
    started[0]()  # CUDA starts
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")  # too late for CUDA
    assert hardware_queues() == 32


@pytest.mark.gpu
def test_gpu_hardware_queues_ignore_a_value_set_after_cuda_started(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.init()
    queues_module.watch_cuda_start()  # CUDA has started: notes the variable now
    before = hardware_queues()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32" if before != 32 else "8")
    assert hardware_queues() == before


@pytest.mark.parametrize("value, device, on_gpu, active", [
    (None, "cuda", True, True), ("8", "cuda", True, True), (str(WIDE_QUEUES), "cuda", True, False),
    (None, "cuda", False, False), (None, "cpu", True, False)])
def test_step_hold_is_active_only_for_gpu_decoding_with_few_queues(monkeypatch, value, device, on_gpu, active):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    assert StepHold(torch.device(device), decodes_on_gpu=on_gpu).active is active


def test_inactive_step_hold_touches_no_stream():
    hold = StepHold(torch.device("cpu"))
    hold()
    assert hold.seconds == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_active_step_hold_returns_after_the_streams_work(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    hold = StepHold(torch.device("cuda"))
    assert hold.active
    torch.cuda._sleep(50_000_000)  # a step still running on the current stream
    hold()
    assert torch.cuda.current_stream().query()  # nothing left queued when next() goes on
    assert hold.seconds > 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_hold_with_slack_leaves_the_last_step_queued(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    hold = StepHold(torch.device("cuda"), slack=1)
    torch.cuda._sleep(50_000_000)  # step 1
    hold()  # nothing older than step 1: returns at once
    assert not torch.cuda.current_stream().query()
    torch.cuda._sleep(50_000_000)  # step 2
    hold()  # waits for step 1 alone
    assert not torch.cuda.current_stream().query()  # step 2 still runs
    torch.cuda.synchronize()
