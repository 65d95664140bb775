import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shards(tmp_path):
    from tests.shards import write_shards

    return write_shards(tmp_path / "data", [10, 3, 0, 8, 5])


@pytest.fixture(autouse=True)
def queues_as_the_variable_says(monkeypatch):
    """Each test sees CUDA_DEVICE_MAX_CONNECTIONS as it sets it, as a process does before CUDA starts (on the GPU
    machine CUDA started in an earlier test, and the queues it started with would hide the test's setting)."""
    from datapipe.device import queues

    monkeypatch.setattr(queues, "_AT_CUDA_START", {})
