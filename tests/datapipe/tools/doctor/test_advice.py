"""datapipe.tools.doctor.advice: what a batch holds, and the advice rules (each with the number that triggered it)."""
import torch

from datapipe.tools.doctor.advice import advise, inspect_batch


def _m(wait=0.3, workers=0, cores=4, cuda=False, **batch):
    return {"wait_fraction": wait, "cores": cores, "cuda": cuda, "loader": {"num_workers": workers},
            "batch": batch, "rates": {}}


def _ids(m):
    return [a["id"] for a in advise(m)]


def test_advice_rules():
    assert "more_workers" in _ids(_m(wait=0.3, workers=1, cores=4))
    assert "30%" in next(a for a in advise(_m(wait=0.3)) if a["id"] == "more_workers")["advice"]
    assert "more_workers" not in _ids(_m(wait=0.05, workers=1, cores=4))
    assert "more_workers" not in _ids(_m(wait=0.3, workers=4, cores=4))
    assert "cpu_bound" in _ids(_m(wait=0.3, workers=4, cores=4))
    assert _ids(_m(wait=0.01)) == ["not_bottleneck"]
    assert "pin_memory" in _ids(_m(cuda=True, unpinned_host_tensors=2))
    assert "pin_memory" not in _ids(_m(cuda=False, unpinned_host_tensors=2))
    assert "pin_memory" not in _ids(_m(cuda=True, unpinned_host_tensors=0))
    assert "gpu_decode" in _ids(_m(cuda=True, images_on_host=[32, 3, 224, 224]))
    assert "gpu_decode" in _ids(_m(cuda=True, jpeg_bytes=True))
    assert "gpu_decode" not in _ids(_m(cuda=False, images_on_host=[32, 3, 224, 224]))
    assert "gpu_decode" not in _ids(_m(wait=0.01, cuda=True, images_on_host=[32, 3, 224, 224]))
    rb = [a for a in advise(_m(cuda=True, batch_size=30)) if a["id"] == "round_batch"]
    assert rb and "32" in rb[0]["advice"] and rb[0]["trigger"] == {"batch_size": 30}
    assert "round_batch" not in _ids(_m(cuda=True, batch_size=32))
    assert "round_batch" not in _ids(_m(cuda=False, batch_size=30))
    assert "packing" in _ids(_m(padding_fraction=0.3))
    assert "packing" not in _ids(_m(padding_fraction=0.1))
    m = _m(wait=0.3)
    m["rates"] = {"capacity_batches_per_s": 10.0, "consumption_batches_per_s": 20.0}
    cap = next(a for a in advise(m) if a["id"] == "capacity")
    assert "50%" in cap["advice"]
    m["rates"] = {"capacity_batches_per_s": 40.0, "consumption_batches_per_s": 20.0}
    assert "prefetch" in _ids(m) and "capacity" not in _ids(m)


def test_recycled_workers_advice_for_torchs_loader_waited_on_with_workers():
    def m(wait=0.3, workers=4, cuda=True, kind="torch.utils.data.dataloader.DataLoader", host=2):
        out = _m(wait=wait, workers=workers, cores=16, cuda=cuda, host_tensors=host)
        out["loader"]["type"] = kind
        return out

    advice = next(a for a in advise(m()) if a["id"] == "recycled_workers")
    assert "30%" in advice["advice"] and "4 workers" in advice["advice"] and "device='cuda'" in advice["advice"]
    assert "recycled_workers" not in _ids(m(wait=0.05))  # not waiting: nothing to gain
    assert "recycled_workers" not in _ids(m(workers=0))  # no worker processes, no shared memory
    assert "recycled_workers" not in _ids(m(cuda=False))  # the recycling needs the GPU path
    assert "recycled_workers" not in _ids(m(kind="loaders.dataloader.loader.DataLoader"))  # ours already
    assert "recycled_workers" not in _ids(m(host=0))  # batches already on the device


def test_inspect_batch():
    info = inspect_batch((torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.int64)))
    assert info["batch_size"] == 8 and info["images_on_host"] == [8, 3, 32, 32]
    assert info["devices"] == ["cpu"] and info["unpinned_host_tensors"] == 2
    assert inspect_batch({"jpg": [b"\xff\xd8\xff\xe0rest", b"\xff\xd8\xff\xe0x"]})["jpeg_bytes"]
    assert not inspect_batch({"txt": [b"hello", b"world"]})["jpeg_bytes"]
    labels = torch.tensor([[1, 2, -100, -100]])
    assert inspect_batch({"labels": labels})["pad"] == 2


def test_hybrid_decode_advice_when_the_loader_costs_the_step_without_waits():
    def m(ratio=0.97, wait=0.005, hw=0.75, cores=16, cuda=True, auto=False):
        return {**_m(wait=wait, cores=cores, cuda=cuda), "ceiling_ratio": ratio,
                "loader": {"num_workers": None, "hw_decoder_load": hw, "hw_decoder_auto": auto}}

    advice = next(a for a in advise(m()) if a["id"] == "hybrid_decode")
    assert "97.0%" in advice["advice"] and 'hw_decoder_load="auto"' in advice["advice"]
    assert "With 16 cores" in advice["advice"]
    assert advice["trigger"]["hw_decoder_load"] == 0.75
    assert "hybrid_decode" not in _ids(m(ratio=0.985))  # at the ceiling already
    assert "hybrid_decode" not in _ids(m(wait=0.05))  # waiting for data: decoding slower would hurt
    assert "hybrid_decode" not in _ids(m(hw=0.0))  # already off the hardware decoder
    assert "hybrid_decode" not in _ids(m(hw=None))  # not an ImageLoader
    assert "hybrid_decode" not in _ids(m(cores=6))  # too few cores for the Huffman stage
    assert "hybrid_decode" not in _ids(m(auto=True))  # "auto" chose the hardware decoder itself (the loop waited)
    assert "hybrid_decode" not in _ids(m(cuda=False))
    assert "hybrid_decode" not in _ids({**m(), "ceiling_ratio": None})  # no ceiling measured


def test_cuda_connections_advice_for_an_image_loader_waiting_on_gpu_work():
    def m(wait=0.05, ratio=None, cuda=True, kind="loaders.images.loader.ImageLoader", connections=None):
        out = {**_m(wait=wait, cores=16, cuda=cuda), "ceiling_ratio": ratio, "cuda_device_max_connections": connections}
        out["loader"]["type"] = kind
        return out

    advice = next(a for a in advise(m()) if a["id"] == "cuda_connections")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in advice["advice"] and "before CUDA starts" in advice["advice"]
    assert "datapipe does not set it" in advice["advice"]
    assert advice["trigger"]["cuda_device_max_connections"] is None
    assert "cuda_connections" in _ids(m(wait=0.005, ratio=0.95))  # no waits, but the step runs below its ceiling
    assert "cuda_connections" not in _ids(m(wait=0.005, ratio=0.99))  # neither waits nor a slowed step
    assert "cuda_connections" not in _ids(m(connections=32))  # already set
    assert "cuda_connections" in _ids(m(connections=8))
    assert "cuda_connections" not in _ids(m(kind="torch.utils.data.dataloader.DataLoader"))
    assert "cuda_connections" not in _ids(m(cuda=False))


def test_no_steps_gets_no_advice_about_the_model():
    assert _ids({**_m(wait=0.0), "steps": 0}) == ["no_steps"]
    assert "not_bottleneck" in _ids({**_m(wait=0.0), "steps": 5})


def test_an_input_bound_image_loader_is_told_about_its_own_settings():
    m = _m(wait=0.3, workers=None, cuda=True)
    m["loader"]["type"] = "loaders.images.loader.ImageLoader"
    (a,) = [a for a in advise(m) if a["id"] == "input_bound"]
    assert "num_threads" in a["advice"] and "CUDA_DEVICE_MAX_CONNECTIONS=32" in a["advice"]
    (cpu,) = [a for a in advise({**m, "cuda": False}) if a["id"] == "input_bound"]  # no GPU: no GPU decoder to advise
    assert "num_threads" in cpu["advice"] and "CUDA_DEVICE_MAX_CONNECTIONS" not in cpu["advice"]
    assert "wrap the DataLoader" not in a["advice"]  # ImageLoader has no DataLoader to wrap
    plain = [a for a in advise(_m(wait=0.3, workers=None)) if a["id"] == "input_bound"][0]
    assert "wrap the DataLoader" in plain["advice"]


def _startup_run(cuda=False, persistent=False, iterations=2, steady=0.005):
    """The README trial (issue #44): 22.9% wait, 0.34 s of it each pass's first batch, 0.5% after it."""
    wall = 1.5
    loader = {"type": "loaders.dataloader.loader.DataLoader", "num_workers": 2, "persistent_workers": persistent,
              "iterations": iterations, "startup_wait_s": 0.34, "steady_wait_fraction": steady}
    return {"wait_fraction": 0.229, "wall_s": wall, "wait_s": 0.34 + steady * (wall - 0.34), "cores": 2, "cuda": cuda,
            "loader": loader, "loaders": [loader], "batch": {"images_on_host": [32, 3, 64, 64]}, "rates": {}}


def test_a_wait_that_is_start_up_is_advised_as_start_up_not_as_decode():
    for cuda in (False, True):
        advice = advise(_startup_run(cuda=cuda))
        ids = [a["id"] for a in advice]
        assert ids[0] == "startup" and "cpu_bound" not in ids and "gpu_decode" not in ids, ids
        assert "more_workers" not in ids and "cuda_connections" not in ids
        text = advice[0]["advice"]
        assert "0.34 s" in text and "start-up" in text and "23%" in text and "0.5%" in text
        assert "persistent_workers=True" in text and "2 passes" in text
        assert not any("GPU decode" in a["advice"] for a in advice)
        assert "0.5% of the time after start-up" in next(a for a in advice if a["id"] == "not_bottleneck")["advice"]
    persistent = advise(_startup_run(persistent=True))[0]["advice"]
    assert "persistent_workers=True" not in persistent and "no setting shortens it" in persistent
    # start-up and a steady wait as well: the steady state is a bottleneck, so the usual rules apply
    steady = [a["id"] for a in advise(_startup_run(steady=0.3))]
    assert "startup" not in steady and "cpu_bound" in steady


def test_no_gpu_decode_advice_on_a_machine_without_cuda():
    cpu = next(a for a in advise(_m(wait=0.3, workers=4, cores=4, cuda=False)) if a["id"] == "cpu_bound")["advice"]
    assert "GPU" not in cpu.replace("no CUDA GPU", "") and "smaller images" in cpu
    gpu = next(a for a in advise(_m(wait=0.3, workers=4, cores=4, cuda=True)) if a["id"] == "cpu_bound")["advice"]
    assert "GPU decode" in gpu
    m = {**_m(wait=0.3, cuda=False), "loader": {"type": "loaders.images.loader.ImageLoader", "num_workers": None}}
    image = next(a for a in advise(m) if a["id"] == "input_bound")["advice"]
    assert "device='cuda'" not in image and "hardware JPEG decoder" not in image and "smaller" in image


def test_advice_to_shard_smaller_images_names_the_shard_option_that_does_it():
    """The doctor said "resized once before `datapipe shard`" although `datapipe shard --resize` exists (#44)."""
    import argparse

    from datapipe.jobs.shard.cli import configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert "--resize" in parser._option_string_actions
    image = {"type": "loaders.images.loader.ImageLoader", "num_workers": None}
    runs = [_m(wait=0.3, workers=4, cores=4, cuda=c) for c in (False, True)]
    runs += [{**_m(wait=0.3, cuda=c), "loader": image} for c in (False, True)]
    said = [a["advice"] for m in runs for a in advise(m) if "smaller" in a["advice"]]
    assert len(said) == 3 and all("`datapipe shard --resize SHORT_SIDE`" in a for a in said), said
    assert not [a for a in said if "before `datapipe shard`" in a]
