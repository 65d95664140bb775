"""datapipe.device.queues: the hardware queues CUDA gives the process, and StepHold."""
import pytest
import torch

from datapipe.device.queues import DEFAULT_QUEUES, WIDE_QUEUES, StepHold, hardware_queues


@pytest.mark.parametrize("value, queues", [(None, DEFAULT_QUEUES), ("", DEFAULT_QUEUES), ("32", 32), (" 16 ", 16),
                                           ("1", 1), ("0", DEFAULT_QUEUES), ("many", DEFAULT_QUEUES)])
def test_hardware_queues_reads_what_cuda_reads(monkeypatch, value, queues):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    assert hardware_queues() == queues


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
