"""One partition of ``datapipe shard``, as a worker runs it: read, check and transform, write part shards.

:func:`run_partition` runs anywhere (this process, a pool process, a Ray worker): it reads the
partition's records (:mod:`datapipe.jobs.shard.readers`), applies the job's transform (image check, resize /
re-encode, tokenization), writes part shards with :class:`datapipe.ShardWriter` and finally the
partition's done marker (:mod:`datapipe.jobs.shard.journal`).
"""
from __future__ import annotations

import io
import os
import posixpath
import time
from typing import Callable

from datapipe.errors import DataError
from datapipe.image_bytes import truncation
from datapipe.jobs.shard.journal import marker_url, part_pattern, write_json
from datapipe.jobs.shard.options import image_check
from datapipe.jobs.shard.listing import IMAGE_EXTENSIONS
from datapipe.jobs.shard.readers import iter_partition, read_item
from datapipe.storage.locations import local_path


class _Truncated(Exception):
    """An image whose end marker is missing (the message says which)."""


def _image_entry(sample: dict) -> str | None:
    return next((k for k in sample if k in IMAGE_EXTENSIONS.values()), None)


def transform_image(sample: dict, *, resize: int | None, quality: int | None, check: str | bool = "open") -> dict:
    """Check an image, shrink it to a shorter side of ``resize`` and re-encode it as JPEG ``quality``.

    ``check``: ``"open"`` (PIL opens it and reads its size from the header, and a JPEG or PNG must end
    with its end marker: truncated files are caught without a pixel decode), ``"decode"`` (every pixel
    decoded, and the end marker), ``"none"`` (bytes copied unchecked: unsafe, a damaged file reaches
    training). Resizing or re-encoding decodes anyway. An image that fails raises ValueError.
    """
    ext = _image_entry(sample)
    check = image_check(check)
    if ext is None or not (resize or quality or check != "none"):
        return sample
    from PIL import Image, ImageOps

    data = sample[ext]
    if not len(data):
        raise ValueError("empty file")
    try:
        im = Image.open(io.BytesIO(data))  # in memory: nothing to close (a `with` measured 8% slower)
        w, h = im.size
        if w < 1 or h < 1:
            raise ValueError(f"image has size {w}x{h}")
        cut = truncation(data) if check != "none" else None
        if cut is not None:
            raise _Truncated(cut)
        if not (resize or quality):
            if check == "decode":
                im.load()
            return sample
        if "exif" in im.info and im.getexif().get(0x0112, 1) != 1:  # rotate by EXIF (exif_transpose copies)
            im = ImageOps.exif_transpose(im)
        im = im.convert("RGB")
        if resize and min(im.size) > resize:
            w, h = im.size
            scale = resize / min(w, h)
            im = im.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC,
                           reducing_gap=3.0)
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality or 90)
    except _Truncated as e:
        raise ValueError(str(e)) from None
    except Image.UnidentifiedImageError as e:
        raise ValueError("not an image PIL recognises (a text or other file with an image extension?)") from e
    except Exception as e:  # PIL raises many types for damaged files
        what = "open" if check == "open" and not (resize or quality) else "decode"
        raise ValueError(f"PIL cannot {what} the image: {type(e).__name__}: {e}") from e
    out = {k: v for k, v in sample.items() if k != ext}
    out["jpg"] = buf.getvalue()
    return out


class _Transform:
    """What a job does to each raw sample; built inside the worker (tokenizers are loaded there)."""

    def __init__(self, job: dict):
        self.job = job
        self.tokenizer = None
        if job["tokenizer"]:
            from datapipe.jobs.tokenize import load_tokenizer

            self.tokenizer = load_tokenizer(job["tokenizer"])

    def __call__(self, sample: dict) -> dict:
        job = self.job
        if "txt" in sample and isinstance(sample["txt"], str):
            text = sample["txt"]
            out = {"__key__": sample["__key__"], "txt": text.encode("utf-8")}
            if self.tokenizer is not None:
                from datapipe.jobs.tokenize import npy_bytes

                out["npy"] = npy_bytes(self.tokenizer.encode(text))
            return out
        return transform_image(sample, resize=job["resize"], quality=job["quality"], check=job["check_images"])


def _sample_bytes(sample: dict) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__") and hasattr(v, "__len__"))


def _check_item(args: tuple) -> str | None:
    """Check one image file in a pool process, which reads the file itself: None, or why it fails."""
    url, ext, check, opts = args
    try:
        data = read_item(url, opts)
    except (OSError, ValueError):
        return None  # the writing process reads it too and reports why it cannot
    try:
        transform_image({"__key__": "", ext: data}, resize=None, quality=None, check=check)
    except ValueError as e:
        return str(e)
    return None


def stamp_written(path: str, *, run: str) -> dict:
    """Mark a finished local shard for the commit's check: its modification time set one second into the past
    (any later write sets it to the present) and ``{"run", "ino", "size", "mtime_ns"}`` recorded, so that the
    commit of the same run knows the file is the one it wrote, unchanged, without reading it back."""
    st = os.stat(path)
    stamp = (time.time_ns() // 1_000_000_000 - 1) * 1_000_000_000
    os.utime(path, ns=(st.st_atime_ns, stamp))
    return {"run": run, "ino": st.st_ino, "size": st.st_size, "mtime_ns": stamp}


def run_partition(job: dict, part: dict, progress: Callable[[int, int], None] | None = None, *,
                  check_pool=None) -> dict:
    """Read, transform and write one partition; write and return its done marker.

    Under ``job["strict"]`` the first unreadable item raises :class:`DataError` naming it;
    otherwise such items are skipped and listed in the marker. ``check_pool`` (a
    ``multiprocessing`` pool; copy jobs of image items only): the image checks run there, in
    order, while this process reads and writes: the same verdicts, on more cores.
    """
    from datapipe.tar.writer import ShardWriter

    opts = job["storage_options"]
    index = part["index"]
    transform = _Transform(job)
    verdicts = None
    if check_pool is not None and job.get("copy") and part["kind"] == "images" and job["check_images"] != "none":
        verdicts = check_pool.imap(_check_item, [(u, ext, job["check_images"], opts) for u, _, _, ext in part["items"]],
                                   chunksize=16)
    skipped, samples, nbytes = [], 0, 0
    pending_n, pending_b, last = 0, 0, time.monotonic()
    pattern = part_pattern(job, index)
    with ShardWriter(pattern, max_bytes=job["max_bytes"], max_count=job["max_count"], index=job["index"],
                     manifest=False, storage_options=opts) as writer:
        for rec in iter_partition(part):
            sample, error = rec.sample, rec.error
            verdict = next(verdicts) if verdicts is not None else None  # one per item, in item order
            if sample is not None and verdicts is not None:
                if verdict is not None:
                    sample, error = None, verdict
            elif sample is not None:
                try:
                    sample = transform(sample)
                except ValueError as e:
                    sample, error = None, str(e)
            if sample is None:
                if job["strict"]:
                    raise DataError(f"--strict: unreadable input {rec.name}: {error}")
                skipped.append({"item": rec.name, "error": error, **({"lost": rec.lost} if rec.lost else {})})
                continue
            writer.write(sample)
            samples += 1
            size = _sample_bytes(sample)
            nbytes += size
            pending_n, pending_b = pending_n + 1, pending_b + size
            if progress is not None and time.monotonic() - last > 0.2:
                progress(pending_n, pending_b)
                pending_n, pending_b, last = 0, 0, time.monotonic()
    if progress is not None and pending_n:
        progress(pending_n, pending_b)
    if job.get("run"):
        for entry in writer.shards:
            entry["written"] = stamp_written(posixpath.join(posixpath.dirname(local_path(pattern)), entry["name"]),
                                             run=job["run"])
    marker = {"partition": index, "shards": writer.shards, "samples": samples, "bytes": nbytes, "skipped": skipped}
    write_json(marker_url(job, index), marker, opts)
    return marker
