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
3. Commit: the last shards of partitions that are not full are merged, in order, into full shards
   placed after the others (at most one shard of the job is short, the last); the plan of renames is
   written to ``commit.json``; parts are renamed to the dense final names ``shard-000000.tar ...``;
   then ``manifest.json``, ``classes.json`` (image classes) and ``report.json`` are written and the
   journal's bulk is removed (:mod:`datapipe.jobs.shard.commit`).

Ownership: a job holds an exclusive lock on OUT while it runs (:mod:`datapipe.jobs.shard.lock`);
a second job on the same OUT fails at once, naming the holder. The commit verifies every final
shard (present, size and sha256 as written) before it writes the manifest.

Resuming: a re-run with the same arguments finds ``.datapipe-job/config.json`` with the same
fingerprint, skips partitions with done markers, deletes the leftovers of the others, and replays
the (idempotent) commit. A re-run of a completed job verifies the output against its manifest and
rebuilds it when a shard is missing or changed. Final names only ever appear by renaming complete
files. The job directory's layout: :mod:`datapipe.jobs.shard.journal`.

This module runs a job (:func:`shard`) on an engine (the local process pool in
:mod:`datapipe.jobs.shard.local_engine`, Ray in :mod:`datapipe.jobs.shard.ray_engine`); the command
line is :mod:`datapipe.jobs.shard.cli`.
"""
from __future__ import annotations

import logging
import os
import posixpath
import sys
import time
import uuid

from datapipe.errors import DataError
from datapipe.storage.files import filesystem
from datapipe.storage.locations import is_local
from datapipe.jobs.shard.commit import brace_pattern, commit, existing_outputs, remove_outputs, verify_shards
from datapipe.jobs.shard.journal import JOB_DIR, clean_partition, join_url, marker_url, read_json, write_json
from datapipe.jobs.shard.listing import ONE_IMAGE, image_ext
from datapipe.jobs.shard.local_engine import run_local
from datapipe.jobs.shard.lock import OutputLock
from datapipe.jobs.shard.options import ShardOptions, UsageError, check_run
from datapipe.jobs.shard.sources import open_source
from datapipe.words import counted

log = logging.getLogger("datapipe.jobs.shard.job")

JOURNAL_VERSION = 2  # 2: whole-shard partitions and every partition's short last shard merged (issue 44)
SEED_RULE = 2  # shuffled orders from datapipe.order.seeds.derive_seed (1: ad-hoc seeds, before #16)


_FLAGS = {"pattern": "--pattern", "max_bytes": "--max-bytes", "max_count": "--max-count", "shuffle": "--shuffle",
          "seed": "--seed", "resize": "--resize", "quality": "--quality", "check_images": "--check-images",
          "tokenizer": "--tokenizer", "index": "--index"}


def _changed(before: dict, now: dict) -> list[str]:
    """What differs between the config a job recorded and this run's: ``the input (...)``, ``--max-count 5 -> 3``."""
    said = []
    if before.get("src") != now.get("src"):
        said.append(f"the input ({before.get('src')!r}, now {now.get('src')!r})")
    elif any(before.get(k) != now.get(k) for k in ("kind", "fingerprint", "classes")):
        fields = ", or --text-field/--key-field" if now.get("kind") == "text" else ""
        said.append(f"the input (its files or their sizes{fields})")
    said += [f"{flag} {before.get(k)} -> {now.get(k)}" for k, flag in _FLAGS.items() if before.get(k) != now.get(k)]
    if not said and before.get("version") != now.get("version"):
        said.append(f"the journal format ({before.get('version')}, now {now.get('version')})")
    if not said and before != now:
        said.append("how it is partitioned or ordered (--partition-size, --partition-bytes, the seed rule)")
    return said


def _inside(spath: str, opath: str, *, local: bool) -> str | None:
    """``"same"`` when OUT is SRC, ``"inside"`` when OUT lies in the folder SRC, else None (paths on one filesystem)."""
    if local:
        spath, opath = os.path.realpath(spath), os.path.realpath(opath)
    spath, opath = spath.rstrip("/") or "/", opath.rstrip("/") or "/"
    if spath == opath:
        return "same"
    return "inside" if opath.startswith(spath.rstrip("/") + "/") else None


def _check_kind(kind: str, src: str, *, folder: bool) -> None:
    """A UsageError when ``--input-kind`` cannot be what SRC is (a list is one file; an image tree a folder)."""
    if kind == "list" and folder:
        raise UsageError(f"--input-kind list reads one .csv/.jsonl file of path,label rows; {src!r} is a folder "
                         "(an image folder: --input-kind images, or leave it to auto)")
    if kind == "images" and not folder:
        hint = ONE_IMAGE if image_ext(src) else "a list of path,label rows: --input-kind list, or leave it to auto"
        raise UsageError(f"--input-kind images reads a folder of class sub-folders; {src!r} is a file ({hint})")


def shard(src: str, out: str, options: ShardOptions | None = None, *, engine: str = "local",
          workers: int | None = None, progress: bool = True, storage_options: dict | None = None) -> dict:
    """Convert ``src`` into WebDataset shards in the folder ``out``; returns the job report (also ``OUT/report.json``).

    Args:
        src: an image folder (class sub-folders), a .csv/.jsonl list of ``path,label``, JSONL/Parquet
            text (a file or a folder), or tar shards (a file, a folder or a brace spec).
        out: the output folder (a local path or an fsspec URL).
        options: what to write (:class:`ShardOptions`: limits, names, order, checks, transforms).
        engine: ``"local"`` (a process pool) or ``"ray"`` (Ray Data); the shards are the same.
        workers: worker processes (default: the CPU count).
        progress: show a progress bar on stderr.
        storage_options: fsspec options for ``src`` and ``out``.

    Raises :class:`UsageError` for bad options or an ``out`` that already holds shards (without
    ``overwrite``), :class:`~datapipe.jobs.shard.lock.LockedError` when another job writes ``out``,
    ``ValueError`` for input that cannot be listed, and :class:`DataError` for an unreadable item
    under ``strict`` or an output that fails its verification. See the module docstring.
    """
    options = ShardOptions() if options is None else options
    if not isinstance(options, ShardOptions):
        raise UsageError(f"options must be a ShardOptions(...), got {type(options).__name__}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    check_run(engine=engine, workers=workers)
    opts = dict(storage_options or {})
    out = out.rstrip("/") or "/"
    ofs, opath = filesystem(out, opts)
    if ofs.exists(opath) and not ofs.isdir(opath):
        raise UsageError(f"OUT {out!r} is a file: give a folder (new or empty) to hold the shards")
    sfs, spath = filesystem(src, opts) if "{" not in src and "::" not in src else (None, None)
    if sfs is not None and sfs.protocol == ofs.protocol:
        inside = _inside(spath, opath, local=is_local(src) and is_local(out))
        if inside == "same":
            raise UsageError(f"OUT {out!r} is SRC itself: give a separate folder for the shards")
        if inside == "inside":
            raise UsageError(f"OUT {out!r} is inside SRC {src!r}: its shards would be read as input (an image "
                             "folder's class, a tar folder's shards); give a folder outside SRC")
    if sfs is not None and sfs.exists(spath):
        _check_kind(options.kind, src, folder=sfs.isdir(spath))
    with OutputLock(out, storage_options=opts) as lock:
        return _run(src, out, options, engine=engine, workers=workers, progress=progress, opts=opts, lock=lock)


def _run(src: str, out: str, o: ShardOptions, *, engine: str, workers: int, progress: bool, opts: dict,
         lock: OutputLock) -> dict:
    """The job, with OUT locked."""
    t0 = time.perf_counter()
    im, tx = o.images, o.text
    copy = not (im.resize or im.quality or tx.tokenizer)
    source = open_source(src, kind=o.kind, text_field=tx.text_field, key_field=tx.key_field,
                         partition_size=o.partition_size, partition_bytes=o.partition_bytes, max_bytes=o.max_bytes,
                         max_count=o.max_count, shuffle=o.shuffle, seed=o.seed, fill_shards=copy,
                         storage_options=opts)
    text_only = [flag for flag, value in (("--tokenizer", tx.tokenizer), ("--text-field", tx.text_field),
                                          ("--key-field", tx.key_field)) if value]
    if text_only and source.kind != "text":
        one = len(text_only) == 1
        raise UsageError(f"{', '.join(text_only)} {'applies' if one else 'apply'} to text input (JSONL or Parquet); "
                         f"{src!r} is {'an image folder' if source.kind == 'images' else 'a ' + source.kind + ' input'}"
                         f": leave {'it' if one else 'them'} out")
    if source.ignored:
        log.warning("ignored %d files that the %r source does not read: %s", len(source.ignored), source.kind,
                    _some(source.ignored))
    if o.strict and source.skipped:
        bad = source.skipped[0]
        raise DataError(f"--strict: unreadable input {bad['item']}: {bad['error']}")
    job = {
        "version": JOURNAL_VERSION, "src": src, "out": out, "kind": source.kind, "fingerprint": source.fingerprint,
        "pattern": o.pattern, "max_bytes": int(o.max_bytes), "max_count": int(o.max_count), "shuffle": o.shuffle,
        "seed": o.seed, "resize": im.resize, "quality": im.quality, "check_images": im.check,
        "tokenizer": tx.tokenizer, "index": o.index, "partitions": len(source.partitions), "classes": source.classes,
        "copy": copy,
    }
    if o.shuffle:  # the orders of the seed rule (#16): a journal of the earlier rule is not resumed
        job["seed_rule"] = SEED_RULE
    config = dict(job)
    job.update(job_dir=join_url(out, JOB_DIR), storage_options=opts, strict=o.strict)
    # shards this run writes on a local disk are stamped as they are finished, and the commit checks them by that
    # stamp instead of reading them back (journal markers of an earlier run name another run)
    job["run"] = uuid.uuid4().hex if engine == "local" and is_local(out) else None
    config_url = join_url(job["job_dir"], "config.json")
    previous = read_json(config_url, opts)
    same = previous is not None and previous.get("config") == config
    resuming, rebuild = same and not previous.get("broken"), same and bool(previous.get("broken"))
    if resuming and previous.get("complete"):
        problems = _verify_output(out, opts)
        if not problems:
            report = read_json(join_url(out, "report.json"), opts) or {}
            log.info("%s already holds the output of this job (verified); nothing to do", out)
            return dict(report, status="already complete")
        log.warning("%s is broken (%s): rebuilding it", out, "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""))
        resuming, rebuild = False, True
    if not resuming:
        existing = existing_outputs(out, o.pattern, opts)
        if existing and not o.overwrite and not rebuild:
            changed = _changed(previous.get("config") or {}, config) if previous is not None else []
            why = (f"; its input or options changed since it was written: {', '.join(changed)}" if changed else "")
            raise UsageError(f"{out} already holds shards or a manifest ({posixpath.basename(existing[0])}, ...)"
                             f"{why}: pass --overwrite to replace them, or choose another OUT")
        remove_outputs(out, o.pattern, opts)
        fs, path = filesystem(out, opts)
        fs.makedirs(posixpath.join(path, JOB_DIR, "done"), exist_ok=True)
        write_json(config_url, {"config": config, "complete": False}, opts)

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
               disable=None if progress else True, dynamic_ncols=True)
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
            runner = run_local(job, todo, workers=workers, progress=advance, lock_fd=lock.fileno())
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
    try:
        manifest = commit(job, ordered, skipped=len(skipped), ignored=len(source.ignored))
    except DataError:  # the final shards are not as written: the next run of this job rebuilds them
        write_json(config_url, {"config": config, "complete": False, "broken": True}, opts)
        raise
    seconds = time.perf_counter() - t0
    written = sum(m["bytes"] for m in ordered)
    report = {
        "status": "ok", "src": src, "out": out, "kind": source.kind, "engine": engine, "workers": workers,
        "samples": manifest["num_samples"], "shards": len(manifest["shards"]), "bytes": manifest["num_bytes"],
        "read_as": reads_all(out, o.pattern, len(manifest["shards"])),
        "value_bytes": written, "partitions": len(source.partitions), "resumed_partitions": resumed,
        "num_skipped": len(skipped), "num_lost_samples": sum(s.get("lost", 0) for s in skipped),
        "skipped": skipped, "num_ignored": len(source.ignored),
        "ignored": source.ignored, "check_images": im.check, "classes": len(source.classes or []),
        "seconds": round(seconds, 3), "samples_per_s": round(manifest["num_samples"] / seconds, 1),
        "mb_per_s": round(manifest["num_bytes"] / 1e6 / seconds, 2),
    }
    write_json(join_url(out, "report.json"), report, opts)
    write_json(config_url, {"config": config, "complete": True}, opts)
    fs, path = filesystem(job["job_dir"], opts)
    for sub in ("parts", "done", "merged", "merged.json", "commit.json"):
        if fs.exists(posixpath.join(path, sub)):
            fs.rm(posixpath.join(path, sub), recursive=True)
    if skipped:
        lost = report["num_lost_samples"]
        log.warning("skipped %s%s (listed in %s)", counted(len(skipped), "unreadable item"),
                    f", and {counted(lost, 'sample')} never read after the cut of a truncated tar" if lost else "",
                    join_url(out, "report.json"))
    return report


def reads_all(out: str, pattern: str, shards: int) -> list[str]:
    """What reads every shard a job wrote to ``out``: the folder (its manifest lists them) and their brace pattern."""
    return [out.rstrip("/") + "/", join_url(out, brace_pattern(pattern, shards))]


def _verify_output(out: str, opts: dict) -> list[str]:
    """What is wrong with a completed job's output: its manifest, and every shard it lists."""
    try:
        manifest = read_json(join_url(out, "manifest.json"), opts)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        return ["manifest.json is missing or unreadable"]
    return verify_shards(out, manifest["shards"], opts)


def _some(names: list[str], n: int = 3) -> str:
    """A few names and how many more: ``a, b, c and 7 more``."""
    shown = ", ".join(str(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _nothing_written(source, skipped: list[dict]) -> str:
    """One line saying why a job wrote no sample."""
    why = f"wrote no samples from {source.url!r} (read as {source.kind!r})"
    if skipped:
        first = skipped[0]
        why += (f": all {counted(len(skipped), 'input item')} {'was' if len(skipped) == 1 else 'were'} skipped, "
                f"e.g. {first['item']}: {first['error']}")
    else:
        why += ": the input holds no records"
    if source.ignored:
        why += f"; {counted(len(source.ignored), 'file')} ignored as not {source.kind} input ({_some(source.ignored)})"
    return why + "; see report.json, or choose --input-kind"
