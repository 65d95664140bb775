"""The ``datapipe shard`` job: convert image folders, path lists, JSONL/Parquet text or tars into shards.

How a job runs (the same for ``engine="local"`` and ``engine="ray"``):

1. The input is listed and cut into partitions (:mod:`datapipe.jobs.shard.sources`); partitioning depends on
   the input and the options only, so any engine and any number of workers give the same shards.
   A copy job (image bytes kept as they are) cuts an image folder where the writer would start a
   new shard, so every partition is exactly one shard and no tail is merged; the local engine then
   writes in one process and spreads only the image checks over a process pool.
2. Every partition is read, transformed (image check, ``check_images``: PIL opens each image and
   reads its size by default, ``"decode"`` decodes it, ``"none"`` trusts it; resize / re-encode;
   tokenization) and written by its worker into its own part shards
   ``OUT/.datapipe-job/parts/part-<p>-<n>.tar``
   (each written atomically by :class:`datapipe.ShardWriter`). Then the worker writes its *done
   marker* ``OUT/.datapipe-job/done/p<p>.json`` (shard entries, skipped items), atomically
   (:mod:`datapipe.jobs.shard.partition`).
3. Commit: the small last shards of partitions (under half the limits) are merged, in order, into
   full shards; the plan of renames is written to ``commit.json``; parts are renamed to the dense
   final names ``shard-000000.tar ...``; then ``manifest.json``, ``classes.json`` (image classes)
   and ``report.json`` are written and the journal's bulk is removed (:mod:`datapipe.jobs.shard.commit`).

Resuming: a re-run with the same arguments finds ``.datapipe-job/config.json`` with the same
fingerprint, skips partitions with done markers, deletes the leftovers of the others, and replays
the (idempotent) commit. Final names only ever appear by renaming complete files. The job
directory's layout: :mod:`datapipe.jobs.shard.journal`.

This module runs a job (:func:`shard`) on an engine (the local process pool here, Ray in
:mod:`datapipe.jobs.shard.ray_engine`); the command line is :mod:`datapipe.jobs.shard.cli`.
"""
from __future__ import annotations

import logging
import os
import posixpath
import sys
import time
from typing import Callable, Iterator

from datapipe.errors import DataError
from datapipe.storage.files import filesystem
from datapipe.jobs.shard.commit import commit, existing_outputs, remove_outputs
from datapipe.jobs.shard.journal import JOB_DIR, clean_partition, join_url, marker_url, read_json, write_json
from datapipe.jobs.shard.options import UsageError, check_options, image_check
from datapipe.jobs.shard.partition import run_partition
from datapipe.jobs.shard.sources import open_source

log = logging.getLogger("datapipe.jobs.shard.job")

JOURNAL_VERSION = 1
SEED_RULE = 2  # shuffled orders from datapipe.order.seeds.derive_seed (1: ad-hoc seeds, before #16)
CHECK_POOL_MIN_ITEMS = 256  # fewer images are checked in the writing process (a pool costs more)


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
    check_options(kind=kind, max_bytes=max_bytes, max_count=max_count, pattern=pattern, resize=resize,
                  quality=quality, workers=workers, engine=engine, partition_size=partition_size,
                  partition_bytes=partition_bytes, tokenizer=tokenizer)
    check_images = image_check(check_images)
    out = out.rstrip("/") or "/"
    ofs, opath = filesystem(out, opts)
    if ofs.exists(opath) and not ofs.isdir(opath):
        raise UsageError(f"OUT {out!r} is a file: give a folder (new or empty) to hold the shards")
    sfs, spath = filesystem(src, opts) if "{" not in src and "::" not in src else (None, None)
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
    if shuffle:  # the orders of the seed rule (#16): a journal of the earlier rule is not resumed
        job["seed_rule"] = SEED_RULE
    config = dict(job)
    job.update(job_dir=join_url(out, JOB_DIR), storage_options=opts, strict=strict)
    previous = read_json(join_url(job["job_dir"], "config.json"), opts)
    resuming = previous is not None and previous.get("config") == config
    if resuming and previous.get("complete"):
        report = read_json(join_url(out, "report.json"), opts)
        if report is not None:
            log.info("%s already holds the output of this job; nothing to do", out)
            return dict(report, status="already complete")
        resuming = False
    if not resuming:
        existing = existing_outputs(out, pattern, opts)
        if existing and not overwrite:
            raise UsageError(f"{out} already holds shards or a manifest ({posixpath.basename(existing[0])}, ...): "
                             "pass --overwrite to replace them, or choose another OUT")
        remove_outputs(out, pattern, opts)
        fs, path = filesystem(out, opts)
        fs.makedirs(posixpath.join(path, JOB_DIR, "done"), exist_ok=True)
        write_json(join_url(job["job_dir"], "config.json"), {"config": config, "complete": False}, opts)

    markers: dict[int, dict] = {}
    for p in source.partitions:
        m = read_json(marker_url(job, p["index"]), opts)
        if m is not None:
            markers[p["index"]] = m
    todo = [p for p in source.partitions if p["index"] not in markers]
    for p in todo:
        clean_partition(job, p["index"])
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
            from datapipe.jobs.shard.ray_engine import run_ray

            runner = run_ray(job, todo, workers=workers, progress=advance)
        else:
            runner = run_local(job, todo, workers=workers, progress=advance)
        for marker in runner:
            markers[marker["partition"]] = marker
    except DataError as e:
        write_json(join_url(out, "report.json"), {"status": "failed", "error": str(e), "src": src, "out": out}, opts)
        raise
    finally:
        bar.close()

    ordered = [markers[p["index"]] for p in sorted(source.partitions, key=lambda p: p["index"])]
    skipped = source.skipped + [s for m in ordered for s in m["skipped"]]
    if not sum(m["samples"] for m in ordered):
        why = _nothing_written(source, skipped)
        failure = {"status": "failed", "error": why, "src": src, "out": out, "num_skipped": len(skipped),
                   "skipped": skipped, "num_ignored": len(source.ignored), "ignored": source.ignored}
        write_json(join_url(out, "report.json"), failure, opts)
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
    write_json(join_url(out, "report.json"), report, opts)
    write_json(join_url(job["job_dir"], "config.json"), {"config": config, "complete": True}, opts)
    fs, path = filesystem(job["job_dir"], opts)
    for sub in ("parts", "done", "merged", "merged.json", "commit.json"):
        if fs.exists(posixpath.join(path, sub)):
            fs.rm(posixpath.join(path, sub), recursive=True)
    if skipped:
        log.warning("skipped %d unreadable items (listed in %s)", len(skipped), join_url(out, "report.json"))
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
