"""The peers benchmark's source: an image folder of class sub-folders of JPEGs, made once (ImageNet-like renders,
every file distinct) or taken from WebDataset shards; every system writes its own format from it."""
from __future__ import annotations

import os
import shutil

from datapipe.tools.bench.peer_readers import list_images


def _render(args: tuple) -> list[tuple[bytes, int]]:
    from datapipe.tools.synthetic import iter_image_samples

    start, count, kwargs = args
    return [(s["jpg"], int(s["cls"])) for s in iter_image_samples(count, start=start, **kwargs)]


def _with_comment(jpg: bytes, text: str) -> bytes:
    """``jpg`` with a JPEG comment segment (COM) after its start marker: other bytes, the same pixels."""
    payload = text.encode("ascii")
    return jpg[:2] + b"\xff\xfe" + (len(payload) + 2).to_bytes(2, "big") + payload + jpg[2:]


def make_image_folder(folder: str, *, num_images: int, num_classes: int = 10, size: tuple[int, int] = (500, 375),
                      seed: int = 0, distinct: int = 2000, workers: int | None = None) -> str:
    """ImageNet-like JPEGs in ``folder/<class>/<key>.jpg`` (made once; an existing folder is kept).

    Up to ``distinct`` images are rendered (in ``workers`` processes, default the usable cores); image ``i``
    past them is render ``i % distinct`` with a JPEG comment naming ``i``: every file differs, and decoding
    costs what decoding a render costs.
    """
    from datapipe.device.autotune import usable_cores

    if os.path.isdir(folder) and list_images(folder):
        return folder
    if num_images < 1 or distinct < 1:
        raise ValueError(f"num_images and distinct must be >= 1, got {num_images} and {distinct}")
    renders = min(num_images, distinct)
    procs = max(1, min(workers or usable_cores(), renders // 50 or 1))
    kwargs = {"seed": seed, "num_classes": num_classes, "size": size}
    step = -(-renders // procs)
    chunks = [(start, min(step, renders - start), kwargs) for start in range(0, renders, step)]
    if procs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(procs) as pool:
            pool_out = pool.map(_render, chunks)
    else:
        pool_out = [_render(c) for c in chunks]
    rendered = [r for chunk in pool_out for r in chunk]
    tmp = folder.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    for i in range(num_images):
        jpg, label = rendered[i % renders]
        d = os.path.join(tmp, f"class{label:04d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:08d}.jpg"), "wb") as f:
            f.write(jpg if i < renders else _with_comment(jpg, f"datapipe peers image {i}"))
    os.rename(tmp, folder)
    return folder


def folder_from_shards(shards: list[str], folder: str) -> str:
    """The images of WebDataset shards (``jpg``/``png`` + ``cls``) as a class-folder tree: every system's source."""
    from datapipe import ShardStream
    from datapipe.tools.bench.baselines import image_bytes

    for s in ShardStream(shards, rank=0, world_size=1):
        d = os.path.join(folder, f"class{int(bytes(s['cls'])):04d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, s["__key__"].replace("/", "_") + ".jpg"), "wb") as f:
            f.write(bytes(image_bytes(s)))
    return folder
