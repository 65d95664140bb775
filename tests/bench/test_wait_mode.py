import time

import pytest
import torch

from bench.wait_mode import set_wait_mode, wait_mode


def test_unknown_mode_is_refused_before_touching_cuda():
    with pytest.raises(ValueError, match="blocking"):
        set_wait_mode("sleepy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message")
def test_without_cuda_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        set_wait_mode("blocking")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        wait_mode()


def _cpu_share_of_a_wait(wait, seconds: float = 0.2) -> float:
    """CPU time this thread spends waiting for a GPU kernel of ``seconds``, over the wall time."""
    cycles = int(seconds * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate: kHz
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    event = torch.cuda.Event()
    event.record()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    wait(event)
    return (time.thread_time() - cpu0) / (time.perf_counter() - t0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocking_mode_frees_the_core_of_a_device_wait_and_spin_holds_it():
    device_wait = lambda e: torch.cuda.synchronize()  # noqa: E731
    previous = set_wait_mode("blocking")
    try:
        assert wait_mode() == "blocking"
        blocked = _cpu_share_of_a_wait(device_wait)
        assert set_wait_mode("spin") == "blocking"
        assert wait_mode() == "spin"
        spun = _cpu_share_of_a_wait(device_wait)
    finally:
        set_wait_mode(previous)
    assert wait_mode() == previous
    assert blocked < 0.2, f"a blocking wait used {blocked:.0%} of a core"
    assert spun > 0.8, f"a spinning wait used only {spun:.0%} of a core"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_plain_event_wait_spins_even_in_blocking_mode():
    """What DALI's threads do (cudaEventSynchronize on events without the blocking flag): the
    context's mode does not reach them, so blocking mode cannot free their cores."""
    previous = set_wait_mode("blocking")
    try:
        spun = _cpu_share_of_a_wait(lambda e: e.synchronize())
    finally:
        set_wait_mode(previous)
    assert spun > 0.8, f"a plain event wait in blocking mode used only {spun:.0%} of a core"
