"""The baselines every datapipe benchmark compares against, written once.

``datapipe bench loader``, the doctor and the scripts in ``bench/`` all take their baselines from here:

- the CPU image transforms a torch user writes (:class:`PilEval`: resize the shorter side, center crop,
  normalise; :class:`PilTrain`: random-resized-crop, flip, normalise; torchvision's when installed);
- :func:`webdataset_images`: ``webdataset.WebDataset`` + PIL decode + one of those transforms;
- :func:`torch_loader` (torch's ``DataLoader`` over it) and :func:`webdataset_loader` (``webdataset.WebLoader``);
- :class:`DaliBaseline`: the DALI graph a user writes by hand (``fn.readers.webdataset`` -> decode -> resize
  -> ``crop_mirror_normalize``), iterated with ``pipe.run()``;
- :func:`endless` (epoch after epoch of a loader), :func:`replay` (one cached batch forever: the data-free
  source of a ceiling) and :func:`close` (shut an iterator's workers down).

Every image baseline yields ``(images, labels)``: float32 NCHW images normalised with the ImageNet mean/std
and int64 labels from the ``cls`` entry. webdataset, DALI and torchvision are imported when used.
"""
from __future__ import annotations

import io
import math
import os
import random
import tempfile
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.utils.data

from datapipe.image_bytes import IMAGE_ENTRIES

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# every image entry datapipe shard writes (PIL decodes them all); the hand-written DALI graph reads all but GIF,
# which DALI cannot decode (ImageLoader re-encodes it; the DALI baseline does not: datapipe.tools.bench.dali_check)
IMAGE_EXTS = IMAGE_ENTRIES
DALI_EXTS = tuple(ext for ext in IMAGE_ENTRIES if ext != "gif")
_MEAN = np.array(MEAN, dtype=np.float32)
_STD = np.array(STD, dtype=np.float32)


# ---- CPU transforms -----------------------------------------------------------------------------------
def _normalised(img) -> torch.Tensor:
    a = (np.asarray(img, dtype=np.float32) / 255.0 - _MEAN) / _STD
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


class PilEval:
    """PIL image -> resize the shorter side to ``size`` -> center crop -> normalise -> float32 CHW tensor.

    Args:
        size: the output's height and width.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size

    def __call__(self, img) -> torch.Tensor:
        from PIL import Image

        img = img.convert("RGB")
        w, h = img.size
        scale = self.size / min(w, h)
        nw, nh = max(self.size, round(w * scale)), max(self.size, round(h * scale))
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = (nw - self.size) // 2, (nh - self.size) // 2
        return _normalised(img.crop((left, top, left + self.size, top + self.size)))


class PilTrain:
    """torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``ToTensor`` + ``Normalize``.

    Without torchvision, the same steps in PIL (scale 0.08-1, aspect 3/4-4/3, ten attempts, then
    the whole image).

    Args:
        size: the output's height and width.
        torchvision: use torchvision's transforms when it is installed (``False``: always the PIL steps).
    """

    def __init__(self, size: int, *, torchvision: bool = True):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.tv = None
        if torchvision:
            try:
                import torchvision.transforms as T

                self.tv = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                                     T.Normalize(MEAN, STD)])
            except Exception:  # noqa: BLE001 - missing, or a build that does not match this torch
                self.tv = None

    def __call__(self, img) -> torch.Tensor:
        if self.tv is not None:
            return self.tv(img)
        from PIL import Image

        img = img.convert("RGB")
        w, h = img.size
        for _ in range(10):
            area = w * h * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                break
        else:
            cw, ch, x, y = w, h, 0, 0
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _normalised(img)


def transform(size: int, *, train: bool):
    """:class:`PilTrain` when ``train``, else :class:`PilEval`."""
    return PilTrain(size) if train else PilEval(size)


def decode_image(data) -> Any:
    """Encoded image bytes (bytes or a memoryview) -> an RGB PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(bytes(data))).convert("RGB")


def image_bytes(sample: dict):
    """The encoded image of a raw WebDataset sample (its first entry named in ``IMAGE_EXTS``)."""
    for ext in IMAGE_EXTS:
        if ext in sample:
            return sample[ext]
    raise KeyError(f"sample {sample.get('__key__')!r} has no image entry ({', '.join(IMAGE_EXTS)})")


# ---- webdataset / torch -------------------------------------------------------------------------------
def webdataset_images(urls: list[str], *, image_size: int = 224, train: bool = True, batch_size: int | None = None,
                      shuffle_buffer: int = 1000):
    """``webdataset.WebDataset`` -> PIL decode -> the CPU transform -> ``(image, label)``.

    Args:
        urls: shard paths or URLs.
        image_size: output height and width.
        train: :class:`PilTrain` with shard shuffling and a ``shuffle_buffer`` sample buffer; else
            :class:`PilEval` in shard order.
        batch_size: batch inside the dataset (what ``WebLoader`` expects; the last partial batch is kept
            in eval, dropped in training); ``None``: single samples.
        shuffle_buffer: samples in webdataset's shuffle buffer when ``train``.
    """
    import webdataset as wds

    ds = wds.WebDataset(urls, shardshuffle=len(urls) if train else False, nodesplitter=wds.single_node_only,
                        empty_check=False)
    if train and shuffle_buffer > 1:
        ds = ds.shuffle(shuffle_buffer)
    ds = ds.decode("pil").to_tuple(";".join(IMAGE_EXTS), "cls").map_tuple(transform(image_size, train=train), int)
    return ds.batched(batch_size, partial=not train) if batch_size else ds


def torch_loader(urls: list[str], *, batch_size: int, image_size: int = 224, train: bool = True, workers: int = 0,
                 device: str = "cpu") -> torch.utils.data.DataLoader:
    """torch's ``DataLoader`` over :func:`webdataset_images` (``pin_memory`` on CUDA): the usual starting point.

    Args:
        urls: shard paths or URLs.
        batch_size: samples per batch (the last partial batch is dropped when ``train``).
        image_size: output height and width.
        train: augment and shuffle (see :func:`webdataset_images`).
        workers: DataLoader worker processes.
        device: ``"cuda"`` pins the batches; they stay on the host (move them with ``.to(non_blocking=True)``).
    """
    ds = webdataset_images(urls, image_size=image_size, train=train)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, drop_last=train,
                                       pin_memory=device == "cuda", prefetch_factor=2 if workers else None)


def webdataset_loader(urls: list[str], *, batch_size: int, image_size: int = 224, train: bool = True,
                      workers: int = 0, device: str = "cpu"):
    """``webdataset.WebLoader`` over :func:`webdataset_images` batched in the workers (arguments as :func:`torch_loader`)."""
    import webdataset as wds

    ds = webdataset_images(urls, image_size=image_size, train=train, batch_size=batch_size)
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, pin_memory=device == "cuda",
                         prefetch_factor=2 if workers else None)


# ---- hand-written DALI --------------------------------------------------------------------------------
class DaliBaseline:
    """The DALI graph a user writes by hand over WebDataset shards, run with ``pipe.run()``.

    ``fn.readers.webdataset`` -> ``fn.decoders.image_random_crop`` (``train``) or ``fn.decoders.image``
    -> ``fn.resize`` -> ``fn.crop_mirror_normalize`` (random flip when ``train``). Decoding is ``mixed``
    (the GPU, with the hardware JPEG decoder) on CUDA and ``cpu`` otherwise. Iterating yields
    ``(images, labels)`` torch tensors on ``device`` without end (epoch after epoch).

    Args:
        urls: local shard paths (DALI's reader opens files). Their DALI indexes are read from next to
            each shard (``datapipe index``) when present, else written to a temporary folder.
        batch_size: samples per batch.
        image_size: output height and width.
        train: random crop, flip and a shuffled reader; else resize the shorter side and center crop.
        device: ``"cuda"`` or ``"cpu"``.
        threads: DALI's CPU threads.
        hw_decoder_load: share of the hardware JPEG decoder (CUDA only; ``None``: DALI's default).
        seed: DALI's seed.
    """

    def __init__(self, urls: list[str], *, batch_size: int, image_size: int = 224, train: bool = True,
                 device: str = "cpu", threads: int = 4, hw_decoder_load: float | None = None, seed: int = 0):
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        from datapipe.storage.urls import is_local, local_path
        from datapipe.tar.dali_index import default_index_path, write_dali_index

        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if not all(is_local(u) for u in urls):
            raise ValueError("the DALI baseline reads local shards only")
        paths = [local_path(u) for u in urls]
        self._tmp = None
        index = [default_index_path(p) for p in paths]
        if not all(os.path.exists(i) for i in index):
            self._tmp = tempfile.TemporaryDirectory(prefix="datapipe-bench-idx-")
            index = [write_dali_index(p, os.path.join(self._tmp.name, f"{i}.idx")) for i, p in enumerate(paths)]
        self.gpu = device == "cuda"
        self.device = torch.device(device)
        pipe = Pipeline(batch_size=batch_size, num_threads=max(1, threads), device_id=0 if self.gpu else None,
                        seed=seed, prefetch_queue_depth=2)
        decode_device = "mixed" if self.gpu else "cpu"
        extra = {"hw_decoder_load": hw_decoder_load} if self.gpu and hw_decoder_load is not None else {}
        with pipe:
            jpg, cls = fn.readers.webdataset(paths=paths, index_paths=index, ext=[";".join(DALI_EXTS), "cls"],
                                             random_shuffle=train, initial_fill=2000 if train else 1024,
                                             name="Reader")
            if train:
                images = fn.decoders.image_random_crop(jpg, device=decode_device, output_type=types.RGB,
                                                       random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                                       num_attempts=100, **extra)
                images = fn.resize(images, resize_x=image_size, resize_y=image_size,
                                   interp_type=types.INTERP_LINEAR, antialias=True)
                mirror = fn.random.coin_flip(probability=0.5)
            else:
                images = fn.decoders.image(jpg, device=decode_device, output_type=types.RGB, **extra)
                images = fn.resize(images, resize_shorter=image_size, interp_type=types.INTERP_LINEAR,
                                   antialias=True)
                mirror = 0
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                              crop=(image_size, image_size), mirror=mirror,
                                              mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD])
            pipe.set_outputs(images, cls)
        pipe.build()
        self.pipe = pipe

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            stream = torch.cuda.current_stream() if self.gpu else None
            images, labels = self.pipe.run(stream) if self.gpu else self.pipe.run()
            t = images.as_tensor()
            if self.gpu:
                from nvidia.dali.plugin.pytorch import feed_ndarray

                x = torch.empty(t.shape(), dtype=torch.float32, device=self.device)
                feed_ndarray(t, x, cuda_stream=stream)
            else:
                x = torch.from_numpy(np.array(t))
            y = torch.tensor([int(np.asarray(labels.at(i)).tobytes()) for i in range(len(labels))])
            yield x, y.to(self.device, non_blocking=True)


# ---- sources --------------------------------------------------------------------------------------------
def endless(loader: Iterable) -> Iterator:
    """Epoch after epoch of ``loader`` (``set_epoch(epoch)`` first when it has one).

    An epoch that yields nothing raises ``ValueError`` (no silent spin). Closing the generator shuts
    the running epoch's iterator down (its worker processes too).
    """
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        n = 0
        it = iter(loader)
        try:
            for batch in it:
                n += 1
                yield batch
        finally:
            close(it)
        if n == 0:
            raise ValueError("the loader produced no batches")
        epoch += 1


def replay(batch) -> Iterator:
    """The data-free source: the same cached batch, forever (what a ceiling measures a step against)."""
    while True:
        yield batch


def close(it) -> None:
    """Shut an iterator down: torch's worker processes (``_shutdown_workers``) or a generator (``close``)."""
    for name in ("_shutdown_workers", "close"):
        fn = getattr(it, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort at the end of a measurement
                pass


__all__ = ["MEAN", "STD", "IMAGE_EXTS", "DALI_EXTS", "PilEval", "PilTrain", "transform", "decode_image", "image_bytes",
           "webdataset_images", "torch_loader", "webdataset_loader", "DaliBaseline", "endless", "replay", "close"]
