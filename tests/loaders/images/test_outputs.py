"""Host-decoded batches to the loader's dtype and layout (the CPU path of HostUpload)."""
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
