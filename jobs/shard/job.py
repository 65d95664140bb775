"""``datapipe shard SRC OUT``: convert image folders, path lists, JSONL/Parquet text or tars into shards.

How a job runs (the same for ``engine="local"`` and ``engine="ray"``):

1. The input is listed and cut into partitions (:mod:`jobs.shard.sources`); partitioning depends on
   the input and the options only, so any engine and any number of workers give the same shards.
   A copy job (image bytes kept as they are) cuts an image folder where the writer would start a
   new shard, so every partition is exactly one shard and no tail is merged; the local engine then
   writes in one process and spreads only the image checks over a process pool.
2. Every partition is read, transformed (image check, ``check_images``: PIL opens each image and
   reads its size by default, ``"decode"`` decodes it, ``"none"`` trusts it; resize / re-encode;
   tokenization) and written by its worker into its own part shards
   ``OUT/.datapipe-job/parts/part-<p>-<n>.tar``
   (each written atomically by :class:`datapipe.ShardWriter`). Then the worker writes its *done
   marker* ``OUT/.datapipe-job/done/p<p>.json`` (shard entries, skipped items), atomically.
3. Commit: the small last shards of partitions (under half the limits) are merged, in order, into
   full shards; the plan of renames is written to ``commit.json``; parts are renamed to the dense
   final names ``shard-000000.tar ...``; then ``manifest.json``, ``classes.json`` (image classes)
   and ``report.json`` are written and the journal's bulk is removed.

Resuming: a re-run with the same arguments finds ``.datapipe-job/config.json`` with the same
fingerprint, skips partitions with done markers, deletes the leftovers of the others, and replays
the (idempotent) commit. Final names only ever appear by renaming complete files.
"""
from __future__ import annotations

import argparse
import glob as globlib
import io
import json
import logging
import os
import posixpath
import sys
import time
from typing import Any, Callable, Iterator

import fsspec

from datapipe.errors import DataError
from datapipe.tar.manifest import make_manifest, write_manifest
from jobs.shard.sources import KINDS, iter_partition, open_source

log = logging.getLogger("jobs.shard.job")

JOB_DIR = ".datapipe-job"
ENGINES = ("local", "ray")
JOURNAL_VERSION = 1
CHECK_POOL_MIN_ITEMS = 256  # fewer images are checked in the writing process (a pool costs more)


class UsageError(ValueError):
    """A mistake in how the job was asked for (exit status 2)."""


# ---- transforms -----------------------------------------------------------------------------


def _image_entry(sample: dict) -> str | None:
    from jobs.shard.sources import IMAGE_EXTENSIONS

    return next((k for k in sample if k in IMAGE_EXTENSIONS.values()), None)


CHECKS = ("open", "decode", "none")


def image_check(value: str | bool) -> str:
    """Normalise ``check_images``: ``"open"`` (default), ``"decode"``, ``"none"``; True/False mean decode/none."""
    if value is True or value is False:
        return "decode" if value else "none"
    if value not in CHECKS:
        raise UsageError(f"--check-images must be one of {', '.join(CHECKS)}, got {value!r}")
    return value


def transform_image(sample: dict, *, resize: int | None, quality: int | None, check: str | bool = "open") -> dict:
    """Check an image, shrink it to a shorter side of ``resize`` and re-encode it as JPEG ``quality``.

    ``check``: ``"open"`` (PIL opens it and reads its size from the header: no pixel decode),
    ``"decode"`` (every pixel decoded), ``"none"`` (bytes copied unchecked: unsafe, a damaged file
    reaches training). Resizing or re-encoding decodes anyway. An image that fails raises ValueError.
    """
    ext = _image_entry(sample)
    check = image_check(check)
    if ext is None or not (resize or quality or check != "none"):
        return sample
    from PIL import Image, ImageOps

    data = sample[ext]
    try:
        im = Image.open(io.BytesIO(data))  # in memory: nothing to close (a `with` measured 8% slower)
        w, h = im.size
        if w < 1 or h < 1:
            raise ValueError(f"image has size {w}x{h}")
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
            from jobs.tokenize import load_tokenizer

            self.tokenizer = load_tokenizer(job["tokenizer"])

    def __call__(self, sample: dict) -> dict:
        job = self.job
        if "txt" in sample and isinstance(sample["txt"], str):
            text = sample["txt"]
            out = {"__key__": sample["__key__"], "txt": text.encode("utf-8")}
            if self.tokenizer is not None:
                from jobs.tokenize import npy_bytes

                out["npy"] = npy_bytes(self.tokenizer.encode(text))
            return out
        return transform_image(sample, resize=job["resize"], quality=job["quality"], check=job["check_images"])


# ---- one partition (runs on a worker) ---------------------------------------------------------


def _url(directory: str, *names: str) -> str:
    return posixpath.join(directory.rstrip("/"), *names)


def _fs(url: str, options: dict):
    return fsspec.core.url_to_fs(url, **options)


def _write_json(url: str, obj: Any, options: dict) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    fs, path = _fs(url, options)
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    fs.mv(tmp, path)


def _read_json(url: str, options: dict) -> Any | None:
    fs, path = _fs(url, options)
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _sample_bytes(sample: dict) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__") and hasattr(v, "__len__"))


def _check_item(args: tuple) -> str | None:
    """Check one image file in a pool process, which reads the file itself: None, or why it fails."""
    from jobs.shard.sources import read_item

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
    pattern = _url(job["job_dir"], "parts", f"part-{index:06d}-%06d.tar")
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
                skipped.append({"item": rec.name, "error": error})
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
    marker = {"partition": index, "shards": writer.shards, "samples": samples, "bytes": nbytes, "skipped": skipped}
    _write_json(_url(job["job_dir"], "done", f"p{index:06d}.json"), marker, opts)
    return marker


# ---- the local engine -----------------------------------------------------------------------

_progress_queue = None  # set in pool workers by _init_worker only


def _init_worker(queue) -> None:
    global _progress_queue
    _progress_queue = queue


def _pool_run(job: dict, part: dict) -> dict:
    queue = _progress_queue
    report = (lambda n, b: queue.put((n, b))) if queue is not None else None
    return run_partition(job, part, report)


def run_local(job: dict, parts: list[dict], *, workers: int, progress: Callable[[int, int], None]) -> Iterator[dict]:
    """Run partitions in a process pool (in this process when ``workers == 1``); yield done markers.

    Copy jobs (image bytes kept as they are) write in this process, one shard-sized partition
    after the other, and spread only the image checks over ``workers`` processes: writing a
    shard costs less than checking its images, and no partition leaves a tail to merge.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    items = sum(len(p.get("items", ())) for p in parts)
    if job.get("copy") and job["check_images"] != "none" and workers > 1 and items >= CHECK_POOL_MIN_ITEMS:
        with ctx.Pool(workers) as pool:
            for part in parts:
                yield run_partition(job, part, progress, check_pool=pool)
        return
    if workers <= 1 or len(parts) <= 1:
        for part in parts:
            yield run_partition(job, part, progress)
        return
    import queue as queuelib
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    q = ctx.Queue()

    def drain():
        while True:
            try:
                progress(*q.get_nowait())
            except queuelib.Empty:
                return

    todo = list(parts)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(q,)) as pool:
        running = set()
        try:
            while todo or running:
                while todo and len(running) < 2 * workers:  # bounded: a few partitions in flight
                    running.add(pool.submit(_pool_run, job, todo.pop(0)))
                done, running = wait(running, timeout=0.2, return_when=FIRST_COMPLETED)
                drain()
                for fut in done:
                    yield fut.result()  # re-raises a worker's exception here
        except BaseException:
            for fut in running:
                fut.cancel()
            raise
        finally:
            drain()


# ---- job directory, journal, commit --------------------------------------------------------


def _final_glob(pattern: str) -> str:
    import re

    return re.sub(r"%0?\d*d", "*", pattern)


def _existing_outputs(out: str, pattern: str, opts: dict) -> list[str]:
    fs, path = _fs(out, opts)
    if not fs.exists(path):
        return []
    found = fs.glob(posixpath.join(path, _final_glob(pattern)))
    if fs.exists(posixpath.join(path, "manifest.json")):
        found.append(posixpath.join(path, "manifest.json"))
    return sorted(found)


def _remove_outputs(out: str, pattern: str, opts: dict) -> None:
    fs, path = _fs(out, opts)
    for p in _existing_outputs(out, pattern, opts):
        fs.rm(p)
        idx = p[: -len(".tar")] + ".idx" if p.endswith(".tar") else None
        if idx and fs.exists(idx):
            fs.rm(idx)
    for name in ("report.json", "classes.json"):
        if fs.exists(posixpath.join(path, name)):
            fs.rm(posixpath.join(path, name))
    if fs.exists(posixpath.join(path, JOB_DIR)):
        fs.rm(posixpath.join(path, JOB_DIR), recursive=True)


def _clean_partition(job: dict, index: int) -> None:
    """Delete what a killed run left of partition ``index`` (part shards, temporary files, indexes)."""
    fs, path = _fs(_url(job["job_dir"], "parts"), job["storage_options"])
    if fs.exists(path):
        for p in fs.glob(posixpath.join(path, f"part-{index:06d}-*")):
            fs.rm(p)


def _move(fs, src: str, dst: str) -> None:
    if fs.exists(src):
        fs.mv(src, dst)


def _idx(path: str) -> str:
    return path[: -len(".tar")] + ".idx" if path.endswith(".tar") else path + ".idx"


def _merge_tails(job: dict, tails: list[dict]) -> list[dict]:
    """Concatenate small part shards, in order, into full shards under ``merged/``; returns their entries."""
    from datapipe.storage.files import open_shard
    from datapipe.tar.reader import iter_samples, reader_for
    from datapipe.tar.writer import ShardWriter

    opts = job["storage_options"]
    done = _read_json(_url(job["job_dir"], "merged.json"), opts)
    if done is not None:
        return done
    fs, mpath = _fs(_url(job["job_dir"], "merged"), opts)
    if fs.exists(mpath):
        fs.rm(mpath, recursive=True)
    with ShardWriter(_url(job["job_dir"], "merged", "merged-%06d.tar"), max_bytes=job["max_bytes"],
                     max_count=job["max_count"], index=job["index"], manifest=False, storage_options=opts) as w:
        for entry in tails:
            url = _url(job["job_dir"], "parts", entry["name"])
            f, seekable = open_shard(url, storage_options=opts)
            try:
                for event in iter_samples(reader_for(f, seekable=seekable), url):
                    w.write({k: bytes(v) if isinstance(v, memoryview) else v
                             for k, v in event.sample.items() if k != "__url__"})
            finally:
                f.close()
    merged = [dict(s, dir="merged") for s in w.shards]
    _write_json(_url(job["job_dir"], "merged.json"), merged, opts)
    return merged


def commit(job: dict, markers: list[dict], *, skipped: int = 0, ignored: int = 0) -> dict:
    """Merge small tails, rename parts to dense final names, write the manifest; idempotent.

    ``skipped``: input items left out as unreadable; ``ignored``: input files the source kind does not
    read (the manifest records the counts; report.json lists them).
    """
    opts = job["storage_options"]
    fs, out_path = _fs(job["out"], opts)
    plan = _read_json(_url(job["job_dir"], "commit.json"), opts)
    if plan is None:
        keep, tails = [], []
        for m in markers:
            for i, s in enumerate(m["shards"]):
                small = s["count"] < job["max_count"] / 2 and s["bytes"] < job["max_bytes"] / 2
                (tails if i == len(m["shards"]) - 1 and small else keep).append((m["partition"], i, dict(s, dir="parts")))
        if len(tails) >= 2:
            ordered = [s for _, _, s in keep] + _merge_tails(job, [s for _, _, s in tails])
        else:
            ordered = [s for _, _, s in sorted(keep + tails, key=lambda t: t[:2])]
        plan = [dict(s, src=_url(s.pop("dir"), s["name"]), name=job["pattern"] % i) for i, s in enumerate(ordered)]
        _write_json(_url(job["job_dir"], "commit.json"), plan, opts)
    jpath = _fs(job["job_dir"], opts)[1]
    for entry in plan:
        src, dst = posixpath.join(jpath, entry["src"]), posixpath.join(out_path, entry["name"])
        _move(fs, src, dst)
        if job["index"]:
            _move(fs, _idx(src), _idx(dst))
    shards = [{k: e[k] for k in ("name", "count", "bytes", "sha256")} for e in plan]
    extra: dict[str, Any] = {"source": {"kind": job["kind"], "url": job["src"]}, "num_skipped": skipped,
                             "num_ignored": ignored, "check_images": job["check_images"]}
    if job["classes"]:
        extra["classes"] = job["classes"]
        _write_json(_url(job["out"], "classes.json"), job["classes"], opts)
    manifest = make_manifest(shards, **extra)
    write_manifest(job["out"], manifest, storage_options=opts)
    return manifest


# ---- the job ---------------------------------------------------------------------------------


def shard(
    src: str,
    out: str,
    *,
    kind: str = "auto",
    max_bytes: int = 1 << 30,
    max_count: int = 100_000,
    pattern: str = "shard-%06d.tar",
    shuffle: bool = False,
    seed: int = 0,
    resize: int | None = None,
    quality: int | None = None,
    check_images: str | bool = "open",
    text_field: str | None = None,
    key_field: str | None = None,
    tokenizer: str | None = None,
    index: bool = False,
    workers: int | None = None,
    engine: str = "local",
    strict: bool = False,
    overwrite: bool = False,
    partition_size: int | None = None,
    partition_bytes: int = 32 << 20,
    progress: bool = True,
    storage_options: dict | None = None,
) -> dict:
    """Convert ``src`` into WebDataset shards in the folder ``out``; returns the job report (also ``OUT/report.json``).

    Raises :class:`UsageError` for bad options or an ``out`` that already holds shards (without
    ``overwrite``), ``ValueError`` for input that cannot be listed, and :class:`DataError` for an
    unreadable item under ``strict``. See the module docstring for the engine and resume design.
    """
    t0 = time.perf_counter()
    opts = dict(storage_options or {})
    workers = (os.cpu_count() or 1) if workers is None else workers
    _check_options(kind=kind, max_bytes=max_bytes, max_count=max_count, pattern=pattern, resize=resize,
                   quality=quality, workers=workers, engine=engine, partition_size=partition_size,
                   partition_bytes=partition_bytes, tokenizer=tokenizer)
    check_images = image_check(check_images)
    out = out.rstrip("/") or "/"
    ofs, opath = _fs(out, opts)
    if ofs.exists(opath) and not ofs.isdir(opath):
        raise UsageError(f"OUT {out!r} is a file: give a folder (new or empty) to hold the shards")
    sfs, spath = _fs(src, opts) if "{" not in src and "::" not in src else (None, None)
    if sfs is not None and sfs.protocol == ofs.protocol and spath.rstrip("/") == opath.rstrip("/"):
        raise UsageError(f"OUT {out!r} is SRC itself: give a separate folder for the shards")
    copy = not (resize or quality or tokenizer)
    source = open_source(src, kind=kind, text_field=text_field, key_field=key_field, partition_size=partition_size,
                         partition_bytes=partition_bytes, max_bytes=max_bytes, max_count=max_count, shuffle=shuffle,
                         seed=seed, fill_shards=copy, storage_options=opts)
    if source.ignored:
        log.warning("ignored %d files that the %r source does not read: %s", len(source.ignored), source.kind,
                    _some(source.ignored))
    if strict and source.skipped:
        bad = source.skipped[0]
        raise DataError(f"--strict: unreadable input {bad['item']}: {bad['error']}")
    job = {
        "version": JOURNAL_VERSION, "src": src, "out": out, "kind": source.kind, "fingerprint": source.fingerprint,
        "pattern": pattern, "max_bytes": int(max_bytes), "max_count": int(max_count), "shuffle": shuffle,
        "seed": seed, "resize": resize, "quality": quality, "check_images": check_images, "tokenizer": tokenizer,
        "index": index, "partitions": len(source.partitions), "classes": source.classes, "copy": copy,
    }
    config = dict(job)
    job.update(job_dir=_url(out, JOB_DIR), storage_options=opts, strict=strict)
    previous = _read_json(_url(job["job_dir"], "config.json"), opts)
    resuming = previous is not None and previous.get("config") == config
    if resuming and previous.get("complete"):
        report = _read_json(_url(out, "report.json"), opts)
        if report is not None:
            log.info("%s already holds the output of this job; nothing to do", out)
            return dict(report, status="already complete")
        resuming = False
    if not resuming:
        existing = _existing_outputs(out, pattern, opts)
        if existing and not overwrite:
            raise UsageError(f"{out} already holds shards or a manifest ({posixpath.basename(existing[0])}, ...): "
                             "pass --overwrite to replace them, or choose another OUT")
        _remove_outputs(out, pattern, opts)
        fs, path = _fs(out, opts)
        fs.makedirs(posixpath.join(path, JOB_DIR, "done"), exist_ok=True)
        _write_json(_url(job["job_dir"], "config.json"), {"config": config, "complete": False}, opts)

    markers: dict[int, dict] = {}
    for p in source.partitions:
        m = _read_json(_url(job["job_dir"], "done", f"p{p['index']:06d}.json"), opts)
        if m is not None:
            markers[p["index"]] = m
    todo = [p for p in source.partitions if p["index"] not in markers]
    for p in todo:
        _clean_partition(job, p["index"])
    resumed = len(markers)
    if resumed:
        log.info("resuming: %d of %d partitions already done", resumed, len(source.partitions))

    from tqdm import tqdm

    done_samples = sum(m["samples"] for m in markers.values())
    bar = tqdm(total=source.num_items, initial=done_samples, unit="sample", desc="shard", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    moved = {"bytes": 0, "t": time.perf_counter()}

    def advance(n: int, b: int) -> None:
        moved["bytes"] += b
        bar.update(n)
        elapsed = max(1e-9, time.perf_counter() - moved["t"])
        bar.set_postfix_str(f"{moved['bytes'] / 1e6 / elapsed:.1f} MB/s", refresh=False)

    try:
        if engine == "ray":
            from jobs.shard.ray_engine import run_ray

            runner = run_ray(job, todo, workers=workers, progress=advance)
        else:
            runner = run_local(job, todo, workers=workers, progress=advance)
        for marker in runner:
            markers[marker["partition"]] = marker
    except DataError as e:
        _write_json(_url(out, "report.json"), {"status": "failed", "error": str(e), "src": src, "out": out}, opts)
        raise
    finally:
        bar.close()

    ordered = [markers[p["index"]] for p in sorted(source.partitions, key=lambda p: p["index"])]
    skipped = source.skipped + [s for m in ordered for s in m["skipped"]]
    if not sum(m["samples"] for m in ordered):
        why = _nothing_written(source, skipped)
        _write_json(_url(out, "report.json"), {"status": "failed", "error": why, "src": src, "out": out,
                                               "num_skipped": len(skipped), "skipped": skipped,
                                               "num_ignored": len(source.ignored), "ignored": source.ignored}, opts)
        raise DataError(why)
    manifest = commit(job, ordered, skipped=len(skipped), ignored=len(source.ignored))
    seconds = time.perf_counter() - t0
    written = sum(m["bytes"] for m in ordered)
    report = {
        "status": "ok", "src": src, "out": out, "kind": source.kind, "engine": engine, "workers": workers,
        "samples": manifest["num_samples"], "shards": len(manifest["shards"]), "bytes": manifest["num_bytes"],
        "value_bytes": written, "partitions": len(source.partitions), "resumed_partitions": resumed,
        "num_skipped": len(skipped), "skipped": skipped, "num_ignored": len(source.ignored),
        "ignored": source.ignored, "check_images": check_images, "classes": len(source.classes or []),
        "seconds": round(seconds, 3), "samples_per_s": round(manifest["num_samples"] / seconds, 1),
        "mb_per_s": round(manifest["num_bytes"] / 1e6 / seconds, 2),
    }
    _write_json(_url(out, "report.json"), report, opts)
    _write_json(_url(job["job_dir"], "config.json"), {"config": config, "complete": True}, opts)
    fs, path = _fs(job["job_dir"], opts)
    for sub in ("parts", "done", "merged", "merged.json", "commit.json"):
        if fs.exists(posixpath.join(path, sub)):
            fs.rm(posixpath.join(path, sub), recursive=True)
    if skipped:
        log.warning("skipped %d unreadable items (listed in %s)", len(skipped), _url(out, "report.json"))
    return report


def _some(names: list[str], n: int = 3) -> str:
    """A few names and how many more: ``a, b, c and 7 more``."""
    shown = ", ".join(str(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _nothing_written(source, skipped: list[dict]) -> str:
    """One line saying why a job wrote no sample."""
    why = f"wrote no samples from {source.url!r} (read as {source.kind!r})"
    if skipped:
        first = skipped[0]
        why += f": all {len(skipped)} input items were skipped, e.g. {first['item']}: {first['error']}"
    else:
        why += ": the input holds no records"
    if source.ignored:
        why += f"; {len(source.ignored)} files ignored as not {source.kind} input ({_some(source.ignored)})"
    return why + "; see report.json, or choose --input-kind"


def _check_options(*, kind, max_bytes, max_count, pattern, resize, quality, workers, engine, partition_size,
                   partition_bytes, tokenizer) -> None:
    if kind not in KINDS:
        raise UsageError(f"--input-kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if engine not in ENGINES:
        raise UsageError(f"--engine must be 'local' or 'ray', got {engine!r}")
    if max_bytes <= 0 or max_count <= 0:
        raise UsageError("--max-bytes and --max-count must be positive")
    if "/" in pattern or not pattern.endswith(".tar"):
        raise UsageError(f"--pattern {pattern!r} must be a file name ending in .tar, e.g. 'shard-%06d.tar'")
    try:
        pattern % 0
    except (TypeError, ValueError) as e:
        raise UsageError(f"--pattern {pattern!r} needs one integer placeholder such as %06d") from e
    if pattern % 0 == pattern % 1:
        raise UsageError(f"--pattern {pattern!r} needs one integer placeholder such as %06d")
    if resize is not None and resize < 1:
        raise UsageError("--resize must be a positive shorter-side length in pixels")
    if quality is not None and not 1 <= quality <= 100:
        raise UsageError("--quality must be between 1 and 100")
    if workers < 1:
        raise UsageError("--workers must be >= 1")
    if partition_size is not None and partition_size < 1:
        raise UsageError("--partition-size must be >= 1")
    if partition_bytes < 1:
        raise UsageError("--partition-bytes must be >= 1")
    if tokenizer is not None and tokenizer != "byte" and not tokenizer.endswith(".json"):
        raise UsageError(f"--tokenizer must be 'byte' or a tokenizer.json path, got {tokenizer!r}")


# ---- CLI -------------------------------------------------------------------------------------


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1000000, 512M, 1G)") from None


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="image folder (class sub-folders), .csv/.jsonl list of path,label, "
                                    "JSONL/Parquet text (file or folder), or tar shards (file, folder or brace spec)")
    parser.add_argument("out", help="output folder (local path or fsspec URL)")
    parser.add_argument("--input-kind", default="auto", choices=KINDS, help="what SRC is (default: guess)")
    parser.add_argument("--max-bytes", type=_size, default=1 << 30, help="shard size limit (default 1G)")
    parser.add_argument("--max-count", type=int, default=100_000, help="samples per shard limit (default 100000)")
    parser.add_argument("--pattern", default="shard-%06d.tar", help="shard file names (default shard-%%06d.tar)")
    parser.add_argument("--shuffle", action="store_true", help="shuffle samples (seeded, deterministic)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument("--resize", type=int, metavar="SHORT_SIDE", help="shrink images to this shorter side")
    parser.add_argument("--quality", type=int, metavar="Q", help="re-encode images as JPEG of this quality")
    parser.add_argument("--check-images", nargs="?", const="decode", default="open", choices=CHECKS,
                        help="how images are checked before they are copied: 'open' (default: PIL opens the file "
                             "and reads its size, no pixel decode), 'decode' (full decode; also the meaning of a "
                             "bare --check-images), 'none' (unsafe: damaged files reach the shards)")
    parser.add_argument("--text-field", help="text field of JSONL/Parquet records (default 'text')")
    parser.add_argument("--key-field", help="record field to use as sample key (default: file and offset)")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json: also store token ids as .npy int32")
    parser.add_argument("--index", action="store_true", help="write DALI index files (.idx) beside the shards")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count)")
    parser.add_argument("--engine", default="local", choices=ENGINES, help="local process pool or Ray Data")
    parser.add_argument("--partition-size", type=int, help="items per partition (default: about 2 shards)")
    parser.add_argument("--partition-bytes", type=_size, default=32 << 20, help="JSONL bytes per partition")
    parser.add_argument("--strict", action="store_true", help="fail on the first unreadable input item")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_command(args: argparse.Namespace) -> int:
    try:
        report = shard(args.src, args.out, kind=args.input_kind, max_bytes=args.max_bytes, max_count=args.max_count,
                       pattern=args.pattern, shuffle=args.shuffle, seed=args.seed, resize=args.resize,
                       quality=args.quality, check_images=args.check_images, text_field=args.text_field,
                       key_field=args.key_field, tokenizer=args.tokenizer, index=args.index, workers=args.workers,
                       engine=args.engine, strict=args.strict, overwrite=args.overwrite,
                       partition_size=args.partition_size, partition_bytes=args.partition_bytes,
                       progress=not args.no_progress)
    except UsageError as e:
        print(f"datapipe shard: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, DataError, OSError) as e:
        print(f"datapipe shard: failed: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # one line, no traceback (``datapipe -v`` shows it)
        if getattr(args, "verbose", False):
            raise
        print(f"datapipe shard: failed: {type(e).__name__}: {e} (run `datapipe -v shard ...` for the traceback)",
              file=sys.stderr)
        return 1
    print(f"{report['out']}: {report['samples']} samples in {report['shards']} shards, "
          f"{report['bytes'] / 1e6:.1f} MB, {report['num_skipped']} skipped "
          f"({report['samples_per_s']} samples/s, {report['mb_per_s']} MB/s)")
    return 0
