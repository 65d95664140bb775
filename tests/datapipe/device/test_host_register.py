"""datapipe.device.host_register: page-locking memory the process has, for direct GPU copies."""
import pytest
import torch

from datapipe.device import host_register


def test_without_a_gpu_nothing_is_registered():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answer")
    assert not host_register.available()
    assert host_register.register(torch.zeros(16).data_ptr(), 64) is False


@pytest.mark.gpu
def test_gpu_registered_shared_memory_is_pinned_and_copies_exactly():
    src = torch.arange(1 << 20, dtype=torch.int32).share_memory_()
    storage = src.untyped_storage()
    assert not src.is_pinned()
    assert host_register.register(storage.data_ptr(), storage.nbytes())
    try:
        assert src.is_pinned() and src.pin_memory().data_ptr() == src.data_ptr()  # pinning: the same memory
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out = src.to("cuda", non_blocking=True)
        stream.synchronize()
        assert torch.equal(out.cpu(), src)
    finally:
        host_register.unregister(storage.data_ptr())
    assert not src.is_pinned()


@pytest.mark.gpu
def test_gpu_a_refused_registration_leaves_no_error_behind():
    src = torch.zeros(1 << 16, dtype=torch.uint8).share_memory_()
    ptr, n = src.untyped_storage().data_ptr(), src.untyped_storage().nbytes()
    assert host_register.register(ptr, n)
    try:
        assert host_register.register(ptr, n) is False  # registered already: refused by CUDA
        assert torch.ones(4, device="cuda").add(1).sum().item() == 8  # a launch check finds no stale error
    finally:
        host_register.unregister(ptr)
