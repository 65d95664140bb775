"""The peers benchmark's readers: the image folder every system writes from, and each system's documented
loader over its own format (:func:`open_loader`), handing out ``(keys, values, labels)`` batches of raw bytes
or of decoded, cropped images. :mod:`datapipe.tools.bench.peers` times them."""
from __future__ import annotations

import os
import time
from typing import Callable

SYSTEMS = ("torch", "webdataset", "datapipe", "litdata", "mosaicml")


def list_images(folder: str) -> list[tuple[str, str, int]]:
    """``(path, key, label)`` per image, labels by sorted class folder (as ``datapipe shard`` numbers them)."""
    if not os.path.isdir(folder):
        return []
    classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    out = []
    for label, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(folder, c))):
            if name.lower().endswith((".jpg", ".jpeg")):
                out.append((os.path.join(folder, c, name), f"{c}/{os.path.splitext(name)[0]}", label))
    return out


def read_item(item: tuple[str, str, int]) -> dict:
    path, key, label = item
    with open(path, "rb") as f:
        return {"key": key, "image": f.read(), "cls": label}


# ---- each system's loader ------------------------------------------------------------------------------------------------
class FilesDataset:
    """torch's map-style way over loose files: ``(key, bytes, label)`` or, with ``fn``, ``fn`` of that."""

    def __init__(self, folder: str, fn: Callable | None = None):
        self.items, self.fn = list_images(folder), fn

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s = read_item(self.items[i])
        out = (s["key"], s["image"], s["cls"])
        return self.fn(out) if self.fn else out


def raw_collate(samples: list) -> tuple[list, list, list]:
    """A batch of ``(key, value, label)`` samples as three lists (values stay bytes or become tensors as given)."""
    keys, values, labels = zip(*samples)
    return list(keys), list(values), list(labels)


class Decode:
    """``(key, bytes, label)`` -> ``(key, image tensor, label)`` with PIL and :class:`PilTrain`."""

    def __init__(self, size: int):
        from datapipe.tools.bench.baselines import PilTrain

        self.transform = PilTrain(size)

    def __call__(self, sample):
        from datapipe.tools.bench.baselines import decode_image

        key, data, label = sample
        return key, self.transform(decode_image(data)), label


def _wds_tuple(s: dict):
    return s["__key__"], s["jpg"], int(s["cls"])


def _stream_tuple(s: dict):
    return s["__key__"], bytes(s["jpg"]), int(bytes(s["cls"]))


def _dict_tuple(s: dict):
    return s["key"], s["image"], int(s["cls"])


class _Then:
    """``second(first(x))`` (picklable, for worker processes)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, x):
        return self.second(self.first(x))


def _mosaic_dataset(data: str, *, batch_size: int, seed: int, fn: Callable):
    from streaming import StreamingDataset

    class Mapped(StreamingDataset):  # MosaicML's documented way to transform: override __getitem__
        def __getitem__(self, idx):
            return fn(super().__getitem__(idx))

    return Mapped(local=data, shuffle=True, shuffle_seed=seed, batch_size=batch_size)


def open_loader(system: str, data: str, *, batch_size: int, workers: int, seed: int = 0,
                decode_size: int | None = None, cache_dir: str | None = None):
    """``system``'s documented loader over its own written ``data``: batches of ``(keys, values, labels)``.

    Values are the encoded bytes, or with ``decode_size`` the decoded, augmented image tensors.
    """
    import torch.utils.data

    decode = Decode(decode_size) if decode_size else None
    extra = {"prefetch_factor": 2, "persistent_workers": False} if workers else {}
    if system == "torch":
        ds = FilesDataset(data, decode)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                           collate_fn=raw_collate, generator=torch.Generator().manual_seed(seed),
                                           **extra)
    if system == "webdataset":
        import webdataset as wds

        urls = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".tar"))
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, nodesplitter=wds.single_node_only,
                            empty_check=False).shuffle(1000).map(_Then(_wds_tuple, decode) if decode else _wds_tuple)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate,
                                           **extra)
    if system == "datapipe":
        from datapipe import ShardStream
        from loaders import DataLoader

        stream = ShardStream(data, shuffle=True, shuffle_buffer=200, seed=seed)  # samples too (the README's)
        stream = stream.map(_Then(_stream_tuple, decode) if decode else _stream_tuple)
        return DataLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate, **extra)
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(data, shuffle=True, seed=seed, cache_dir=cache_dir,
                              transform=_Then(_dict_tuple, decode) if decode else _dict_tuple)
        return StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate,
                                   **({"prefetch_factor": 2} if workers else {}))
    if system == "mosaicml":
        from streaming import StreamingDataLoader

        ds = _mosaic_dataset(data, batch_size=batch_size, seed=seed,
                             fn=_Then(_dict_tuple, decode) if decode else _dict_tuple)
        return StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate, **extra)
    raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")


def set_epoch_of(loader, epoch: int) -> None:
    for target in (loader, getattr(loader, "dataset", None)):
        fn = getattr(target, "set_epoch", None)
        if callable(fn):
            fn(epoch)
            return


def one_epoch(loader) -> dict:
    """One epoch: samples, bytes, seconds, first batch time."""
    n = nbytes = 0
    t0 = time.perf_counter()
    first = None
    for keys, values, _ in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(keys)
        nbytes += sum(len(v) for v in values)
    seconds = time.perf_counter() - t0
    return {"samples": n, "seconds": round(seconds, 3), "samples_per_s": round(n / seconds, 1) if seconds else None,
            "mb_per_s": round(nbytes / seconds / 1e6, 1) if seconds else None,
            "first_batch_s": round(first, 3) if first is not None else None}
