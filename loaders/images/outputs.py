"""``ImageLoader``'s outputs as torch tensors: DALI's outputs shared or copied, and host-decoded batches uploaded."""
from __future__ import annotations

from typing import Sequence

import torch


def dali_to_torch(tensor_list, stream, *, device: torch.device, on_gpu: bool, zero_copy: bool = True) -> torch.Tensor:
    """A DALI output as a torch tensor: shared through DLPack (no copy), or copied.

    DALI's default (dynamic) executor allocates every output anew and keeps it alive while
    referenced, so the tensor can share its memory (DALI's own PyTorch iterator does the
    same); the legacy executors recycle output buffers, which must be copied out.
    """
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    t = tensor_list.as_tensor()
    if zero_copy:
        if on_gpu:
            with torch.cuda.device(device):
                return torch.from_dlpack(t)  # ordered after DALI's work on the current stream
        return torch.from_dlpack(t)
    out = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=device if on_gpu else "cpu")
    feed_ndarray(t, out, cuda_stream=stream)
    return out


class HostUpload:
    """(Producer thread) decode_device='cpu': uint8 NHWC on the host -> ``dtype``/``layout`` on ``device``.

    The copy goes through datapipe.device.prefetch's pool of pinned buffers on the producer's side
    stream; then one kernel (``addcmul``: uint8 in, ``dtype`` out) permutes, casts and normalises.
    """

    def __init__(self, device: torch.device, *, dtype: torch.dtype, layout: str, mean: Sequence[float],
                 std: Sequence[float], buffers: int):
        self.device, self.dtype, self.layout = device, dtype, layout
        self.mean, self.std = tuple(mean), tuple(std)
        self.buffers = buffers  # pinned buffers per batch shape
        self._pinned = None  # the pool, made on first use
        self._affine: tuple | None = None  # (shift, scale) per channel, on the device

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            from datapipe.device.prefetch import _CudaTransfer, _PinnedPool

            if self._pinned is None:
                self._pinned = _PinnedPool(per_key=self.buffers, max_bytes=None)
            transfer = _CudaTransfer(self.device, torch.cuda.current_stream(self.device), self._pinned)
            images = transfer(images)[0]
        if self.layout == "NCHW":
            images = images.permute(0, 3, 1, 2)  # a view; the kernel below writes contiguous NCHW
        if self.dtype == torch.uint8:
            return images.contiguous()
        if self._affine is None or self._affine[0].device != images.device:
            shape = (1, 3, 1, 1) if self.layout == "NCHW" else (3,)
            scale = torch.tensor([1 / (255 * s) for s in self.std], dtype=torch.float32).view(shape)
            shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], dtype=torch.float32).view(shape)
            self._affine = (shift.to(images.device), scale.to(images.device))
        shift, scale = self._affine
        out = torch.empty(images.shape, dtype=self.dtype, device=images.device)
        return torch.addcmul(shift, images, scale, out=out)  # (x / 255 - mean) / std
