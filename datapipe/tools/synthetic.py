"""ImageNet-like JPEG datasets made from the photographs that ship with scikit-image.

Every sample is a real photograph (astronaut, coffee, chelsea, rocket, ...), randomly cropped,
rescaled to about 500x375 (landscape or portrait, jittered aspect), flipped, colour-jittered,
given mild sensor grain and JPEG-encoded at quality 85-95 with 4:2:0 or 4:4:4 chroma
subsampling, so decoders and augmentations see the same kind of work as on ImageNet (about
100 KB per image at the default size; ImageNet averages ~110 KB). Labels are ASCII class ids in
the ``cls`` entry; a class fixes the source photo and a colour cast, so labels are learnable.

Sample ``i`` depends only on ``(seed, i)``: the output is the same whatever the chunking or the
number of processes that make it.
"""
from __future__ import annotations

import functools
import io
import os
import sys
from collections.abc import Iterator

import numpy as np

# (name, index into a tuple result or None); all are bundled with scikit-image (no download).
_COLOUR_PHOTOS = (
    ("astronaut", None), ("coffee", None), ("chelsea", None), ("rocket", None),
    ("hubble_deep_field", None), ("immunohistochemistry", None), ("retina", None),
    ("stereo_motorcycle", 0), ("stereo_motorcycle", 1),
)
_GRAY_PHOTOS = (
    ("camera", None), ("coins", None), ("moon", None), ("grass", None), ("gravel", None),
    ("brick", None), ("clock", None), ("cell", None),
)
_GRAIN_TILE = 640
_MAX_SOURCE_SIDE = 800


def _skimage_data():
    """``skimage.data`` (the photographs), or a one-line error naming the extra that installs it."""
    from datapipe.extras import require

    return require("skimage.data", what="the synthetic image generator (datapipe demo, datapipe bench)")


@functools.lru_cache(maxsize=1)
def _photos() -> tuple[np.ndarray, ...]:
    """The source photographs as HxWx3 uint8 arrays (grayscale ones replicated to RGB)."""
    skimage_data = _skimage_data()
    out = []
    for name, index in _COLOUR_PHOTOS + _GRAY_PHOTOS:
        img = getattr(skimage_data, name)()
        if index is not None:
            img = img[index]
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[:, :, None], 3, axis=2)
        out.append(np.ascontiguousarray(img[:, :, :3].astype(np.uint8)))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _pil_photos():
    from PIL import Image

    out = []
    for p in _photos():
        img = Image.fromarray(p)
        shrink = max(img.size) / _MAX_SOURCE_SIDE
        if shrink > 1:
            img = img.resize((round(img.width / shrink), round(img.height / shrink)), Image.Resampling.LANCZOS)
        out.append(img)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _grain():
    """Fixed film-grain tiles (PIL RGB, 128 = no change) of increasing strength."""
    from PIL import Image

    rng = np.random.default_rng(20240601)
    noise = rng.normal(0.0, 1.0, size=(_GRAIN_TILE, _GRAIN_TILE, 3)).astype(np.float32)
    return tuple(
        Image.fromarray(np.clip(128 + sigma * noise, 0, 255).astype(np.uint8)) for sigma in (6.0, 9.0, 12.0)
    )


def _class_style(seed: int, label: int, n_photos: int) -> tuple[int, np.ndarray, tuple[float, float]]:
    """What a class fixes: the source photo, an RGB colour cast and a preferred crop centre."""
    rng = np.random.default_rng([seed, 1, label])
    photo = label % n_photos
    cast = rng.uniform(0.8, 1.2, size=3)
    centre = (rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.7))
    return photo, cast, centre


def render_image(
    index: int,
    *,
    seed: int = 0,
    num_classes: int = 1000,
    quality: tuple[int, int] = (85, 95),
    size: tuple[int, int] = (500, 375),
) -> tuple[bytes, int]:
    """JPEG bytes and class id of sample ``index``; a pure function of its arguments."""
    from PIL import Image, ImageChops

    rng = np.random.default_rng([seed, 0, index])
    label = int(rng.integers(num_classes))
    photos = _pil_photos()
    photo_id, cast, (cy, cx) = _class_style(seed, label, len(photos))
    src = photos[photo_id]
    sw, sh = src.size

    # output size: landscape 70%, portrait 30%, each side jittered by up to +-12%
    w, h = size
    if rng.random() < 0.3:
        w, h = h, w
    w = max(16, int(round(w * rng.uniform(0.88, 1.12))))
    h = max(16, int(round(h * rng.uniform(0.88, 1.12))))

    # crop window with the output's aspect ratio, 30-100% of the largest such window
    aspect = w / h
    cw_max = min(sw, sh * aspect)
    scale = np.sqrt(rng.uniform(0.3, 1.0))
    cw = max(8.0, cw_max * scale)
    ch = cw / aspect
    x0 = np.clip((cx + rng.normal(0, 0.15)) * sw - cw / 2, 0, sw - cw)
    y0 = np.clip((cy + rng.normal(0, 0.15)) * sh - ch / 2, 0, sh - ch)
    resample = Image.Resampling.BILINEAR if rng.random() < 0.5 else Image.Resampling.BICUBIC
    img = src.resize((w, h), resample, box=(x0, y0, x0 + cw, y0 + ch), reducing_gap=2.0)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)

    # colour jitter as one affine colour matrix (class cast x per-image white balance, brightness,
    # contrast, saturation), applied by PIL in C; then film grain from a fixed tile
    gains = cast * rng.uniform(0.9, 1.1, size=3) * rng.uniform(0.75, 1.25)
    contrast = rng.uniform(0.75, 1.3)
    saturation = rng.uniform(0.6, 1.4)
    mean = float(np.asarray(img.reduce(8), dtype=np.float32).mean())
    luma = np.array([0.299, 0.587, 0.114])
    m = saturation * np.eye(3) + (1.0 - saturation) * np.tile(luma, (3, 1))
    m = contrast * gains[:, None] * m
    offset = gains * (1.0 - contrast) * mean
    matrix = tuple(float(v) for row in np.hstack([m, offset[:, None]]) for v in row)
    img = img.convert("RGB", matrix)
    grain = _grain()[int(rng.integers(len(_grain())))]
    gw, gh = grain.size
    gx, gy = int(rng.integers(0, max(1, gw - w))), int(rng.integers(0, max(1, gh - h)))
    if w <= gw and h <= gh:
        img = ImageChops.add(img, grain.crop((gx, gy, gx + w, gy + h)), scale=1.0, offset=-128)

    q = int(rng.integers(quality[0], quality[1] + 1))
    subsampling = 0 if rng.random() < 0.5 else 2  # 4:4:4 or 4:2:0
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=q, subsampling=subsampling)
    return buf.getvalue(), label


def _check_args(num_images: int, num_classes: int, quality, size) -> None:
    _skimage_data()  # before any work: a missing extra is said at once
    if num_images < 0:
        raise ValueError(f"num_images must be >= 0, got {num_images}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if len(quality) != 2 or not 1 <= quality[0] <= quality[1] <= 100:
        raise ValueError(f"quality must be (low, high) with 1 <= low <= high <= 100, got {quality}")
    if len(size) != 2 or min(size) < 16:
        raise ValueError(f"size must be (width, height) with both >= 16, got {size}")


def iter_image_samples(
    num_images: int,
    *,
    seed: int = 0,
    num_classes: int = 1000,
    quality: tuple[int, int] = (85, 95),
    size: tuple[int, int] = (500, 375),
    start: int = 0,
) -> Iterator[dict]:
    """Yield webdataset sample dicts ``{"__key__", "jpg", "cls"}`` for indices ``start..start+num_images-1``."""
    _check_args(num_images, num_classes, quality, size)
    for i in range(start, start + num_images):
        jpg, label = render_image(i, seed=seed, num_classes=num_classes, quality=quality, size=size)
        yield {"__key__": f"{i:08d}", "jpg": jpg, "cls": str(label).encode("ascii")}


def _render_chunk(args: tuple) -> list[dict]:
    start, count, kwargs = args
    return list(iter_image_samples(count, start=start, **kwargs))


def make_image_dataset(
    out_dir: str,
    *,
    num_images: int = 1000,
    num_classes: int = 1000,
    seed: int = 0,
    shard_max_count: int = 1000,
    quality: tuple[int, int] = (85, 95),
    size: tuple[int, int] = (500, 375),
    index: bool = False,
    progress: bool = True,
    num_workers: int = 1,
) -> dict:
    """Write an ImageNet-like JPEG dataset as WebDataset shards into ``out_dir``.

    Shards are ``out_dir/shard-%06d.tar`` (written by :class:`datapipe.ShardWriter`, with
    ``manifest.json``; with ``index=True`` also DALI index files). ``num_workers > 1`` renders
    with a process pool; the bytes are identical for any ``num_workers``. Returns a summary dict:
    ``out_dir``, ``shards``, ``num_images``, ``num_classes``, ``bytes``, ``seconds``, ``images_per_s``.
    """
    import time

    from tqdm import tqdm

    from datapipe.tar.writer import ShardWriter

    _check_args(num_images, num_classes, quality, size)
    if shard_max_count < 1:
        raise ValueError(f"shard_max_count must be >= 1, got {shard_max_count}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    kwargs = dict(seed=seed, num_classes=num_classes, quality=tuple(quality), size=tuple(size))
    os.makedirs(out_dir, exist_ok=True)
    pattern = os.path.join(out_dir, "shard-%06d.tar")
    t0 = time.perf_counter()
    total = 0
    bar = tqdm(total=num_images, unit="img", desc="images", file=sys.stderr, disable=None if progress else True)
    with ShardWriter(pattern, max_count=shard_max_count, max_bytes=1 << 40, index=index) as writer:
        if num_workers == 1:
            for sample in iter_image_samples(num_images, **kwargs):
                writer.write(sample)
                total += len(sample["jpg"])
                bar.update(1)
        else:
            import multiprocessing as mp

            chunk = 64
            jobs = [(s, min(chunk, num_images - s), kwargs) for s in range(0, num_images, chunk)]
            ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            with ctx.Pool(num_workers) as pool:
                for samples in pool.imap(_render_chunk, jobs):
                    for sample in samples:
                        writer.write(sample)
                        total += len(sample["jpg"])
                    bar.update(len(samples))
    bar.close()
    seconds = time.perf_counter() - t0
    shards = sorted(f for f in os.listdir(out_dir) if f.startswith("shard-") and f.endswith(".tar"))
    return {
        "out_dir": out_dir,
        "shards": [os.path.join(out_dir, f) for f in shards],
        "num_images": num_images,
        "num_classes": num_classes,
        "bytes": total,
        "seconds": seconds,
        "images_per_s": num_images / seconds if seconds > 0 else float("inf"),
    }
