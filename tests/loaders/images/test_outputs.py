"""ImageLoader's outputs: host-decoded batches to the loader's dtype and layout (HostUpload); DALI's legacy executor."""
import pytest
import torch

from loaders.images.outputs import HostUpload


def test_host_upload_permutes_casts_and_normalises():
    images = torch.randint(0, 256, (2, 5, 4, 3), dtype=torch.uint8)  # NHWC
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    up = HostUpload(torch.device("cpu"), dtype=torch.float32, layout="NCHW", mean=mean, std=std, buffers=2)
    out = up(images)
    ref = (images.permute(0, 3, 1, 2).float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1)
    assert out.shape == (2, 3, 5, 4) and out.is_contiguous() and torch.allclose(out, ref, atol=1e-5)
    nhwc = HostUpload(torch.device("cpu"), dtype=torch.bfloat16, layout="NHWC", mean=mean, std=std, buffers=2)(images)
    assert nhwc.shape == images.shape and nhwc.dtype == torch.bfloat16
    raw = HostUpload(torch.device("cpu"), dtype=torch.uint8, layout="NCHW", mean=mean, std=std, buffers=2)(images)
    assert torch.equal(raw, images.permute(0, 3, 1, 2))  # uint8: raw pixels, no normalisation


def _legacy_executor(monkeypatch):
    """ImageLoader's DALI pipelines built with DALI's legacy executor (its output buffers are recycled)."""
    from loaders.images import dali_pipeline

    build = dali_pipeline.build_image_pipeline
    monkeypatch.setattr(dali_pipeline, "build_image_pipeline", lambda **kw: build(**{**kw, "exec_dynamic": False}))


def _batches(urls, device, reader):
    from datapipe.stream import ShardStream
    from loaders.images.loader import ImageLoader
    from loaders.images.options import DecodeOptions, ReadOptions

    loader = ImageLoader(ShardStream(urls, shuffle=True, shuffle_buffer=2000, seed=3), batch_size=8, image_size=32,
                         device=device, train=True, decode=DecodeOptions(num_threads=2), read=ReadOptions(reader=reader))
    return [(x.cpu().clone(), y.cpu().clone()) for x, y in loader]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_the_legacy_executor_gives_the_default_executors_batches(tmp_path, monkeypatch, device, reader):
    """DALI's legacy executor (host-synchronised outputs, copied out; bench/ceiling.py rows ending
    ``_legacy``) gives the same batches, in the same order, as the default executor."""
    pytest.importorskip("nvidia.dali")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from datapipe.tools.synthetic import make_image_dataset

    urls = make_image_dataset(str(tmp_path), num_images=40, num_classes=10, seed=5, shard_max_count=12,
                              size=(96, 72), progress=False)["shards"]
    default = _batches(urls, device, reader)
    _legacy_executor(monkeypatch)
    legacy = _batches(urls, device, reader)
    assert len(default) == len(legacy) == 5
    for (x0, y0), (x1, y1) in zip(default, legacy):
        assert torch.equal(y0, y1) and torch.equal(x0, x1)
