"""The commit of ``datapipe shard``: part shards become the final, densely numbered shards.

The last shards of partitions that are not full are merged, in order, into full shards (so at most one
shard of a job is short);
the plan of renames is written to ``commit.json`` before any rename, so a commit interrupted half
way is replayed exactly; every final shard is then verified (present, its size and sha256 as
written) before ``manifest.json`` and ``classes.json`` are written. Also: finding, verifying and
removing the outputs of an earlier job in ``OUT``.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
from typing import Any

from datapipe.errors import DataError
from datapipe.storage.files import filesystem
from datapipe.tar.manifest import SIDECAR_NAME, make_manifest, write_manifest
from datapipe.jobs.shard.journal import JOB_DIR, join_url, read_json, write_json
from datapipe.words import counted


def _final_glob(pattern: str) -> str:
    return re.sub(r"%0?\d*d", "*", pattern)


def brace_pattern(pattern: str, count: int) -> str:
    """The brace pattern naming the ``count`` shards ``pattern`` numbers from 0: ``shard-{000000..000004}.tar``
    (one shard: its name), as :func:`datapipe.expand_urls` reads it."""
    if count <= 1:
        return pattern % 0
    spec = re.search(r"%0?\d*d", pattern)
    return pattern[:spec.start()] + "{" + spec.group() % 0 + ".." + spec.group() % (count - 1) + "}" + \
        pattern[spec.end():]


def existing_outputs(out: str, pattern: str, opts: dict) -> list[str]:
    """The final shards and manifest an earlier job left in ``out``: shards named by ``pattern``, by the
    earlier job's own pattern (its journal) and by its manifest, whatever names they have."""
    fs, path = filesystem(out, opts)
    if not fs.exists(path):
        return []
    patterns = {pattern}
    earlier = _json_or_none(join_url(out, JOB_DIR, "config.json"), opts)
    if isinstance(earlier, dict) and isinstance((earlier.get("config") or {}).get("pattern"), str):
        patterns.add(earlier["config"]["pattern"])
    found = set()
    for p in patterns:
        found |= set(fs.glob(posixpath.join(path, _final_glob(p))))
    manifest_path = posixpath.join(path, "manifest.json")
    if fs.exists(manifest_path):
        found.add(manifest_path)
        manifest = _json_or_none(join_url(out, "manifest.json"), opts)
        for entry in (manifest or {}).get("shards", []) if isinstance(manifest, dict) else []:
            name = entry.get("name") if isinstance(entry, dict) else None
            if isinstance(name, str) and "/" not in name and fs.exists(posixpath.join(path, name)):
                found.add(posixpath.join(path, name))
    return sorted(found)


def _json_or_none(url: str, opts: dict):
    try:
        return read_json(url, opts)
    except ValueError:  # damaged: its files are found by name patterns only
        return None


def file_sha256(fs, path: str) -> str:
    """The sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
    return h.hexdigest()


def _unchanged(fs, path: str, written, run: str | None) -> bool:
    """Whether the local file ``path`` is the one this ``run`` wrote and stamped (``partition.stamp_written``),
    unchanged since: same inode, size and stamped modification time (a write since moves it to the present)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if run is None or not isinstance(written, dict) or written.get("run") != run or "file" not in protocols:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_ino, st.st_size, st.st_mtime_ns) == (written.get("ino"), written.get("size"), written.get("mtime_ns"))


def verify_shards(out: str, shards: list[dict], opts: dict, *, run: str | None = None) -> list[str]:
    """What is wrong with the shards ``shards`` (manifest entries) in ``out``: one line per problem, [] if all
    are present with their size and sha256. Shards are hashed in parallel threads (hashlib and file reads
    release the GIL). ``run``: the job run whose own shards (entries with its ``written`` stamp, on a local
    disk) are known by their unchanged file identity instead of read back and hashed."""
    fs, path = filesystem(out, opts)

    def check(entry: dict) -> str | None:
        p = posixpath.join(path, entry["name"])
        try:
            size = fs.size(p)
        except FileNotFoundError:
            return f"{entry['name']} is missing"
        if size != entry["bytes"]:
            return f"{entry['name']} has {counted(size, 'byte')}, the manifest says {entry['bytes']}"
        if _unchanged(fs, p, entry.get("written"), run):
            return None
        if entry.get("sha256") and file_sha256(fs, p) != entry["sha256"]:
            return f"{entry['name']} does not match the manifest's sha256 (its bytes changed)"
        return None

    threads = min(len(shards), os.cpu_count() or 1, 8)
    if threads <= 1:
        verdicts = [check(entry) for entry in shards]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads, thread_name_prefix="datapipe-verify") as pool:
            verdicts = list(pool.map(check, shards))
    return [v for v in verdicts if v is not None]


def remove_outputs(out: str, pattern: str, opts: dict) -> None:
    """Delete an earlier job's outputs from ``out``: shards, indexes, manifest, reports, job directory."""
    fs, path = filesystem(out, opts)
    for p in existing_outputs(out, pattern, opts):
        fs.rm(p)
        idx = _idx(p) if p.endswith(".tar") else None
        if idx and fs.exists(idx):
            fs.rm(idx)
    for name in ("report.json", "classes.json", SIDECAR_NAME):
        if fs.exists(posixpath.join(path, name)):
            fs.rm(posixpath.join(path, name))
    if fs.exists(posixpath.join(path, JOB_DIR)):
        fs.rm(posixpath.join(path, JOB_DIR), recursive=True)


def _move(fs, src: str, dst: str) -> None:
    if fs.exists(src):
        fs.mv(src, dst)


def _idx(path: str) -> str:
    return path[: -len(".tar")] + ".idx" if path.endswith(".tar") else path + ".idx"


def _merge_tails(job: dict, tails: list[dict]) -> list[dict]:
    """Concatenate small part shards, in order, into full shards under ``merged/``; returns their entries."""
    from datapipe.storage.files import open_shard
    from datapipe.tar.blocks import reader_for
    from datapipe.tar.reader import iter_samples
    from datapipe.tar.writer import ShardWriter

    opts = job["storage_options"]
    done = read_json(join_url(job["job_dir"], "merged.json"), opts)
    if done is not None:
        return done
    fs, mpath = filesystem(join_url(job["job_dir"], "merged"), opts)
    if fs.exists(mpath):
        fs.rm(mpath, recursive=True)
    with ShardWriter(join_url(job["job_dir"], "merged", "merged-%06d.tar"), max_bytes=job["max_bytes"],
                     max_count=job["max_count"], index=job["index"], manifest=False, storage_options=opts) as w:
        for entry in tails:
            url = join_url(job["job_dir"], "parts", entry["name"])
            f, seekable = open_shard(url, storage_options=opts)
            try:
                for event in iter_samples(reader_for(f, seekable=seekable), url):
                    w.write({k: bytes(v) if isinstance(v, memoryview) else v
                             for k, v in event.sample.items() if k != "__url__"})
            finally:
                f.close()
    merged = [dict(s, dir="merged") for s in w.shards]
    write_json(join_url(job["job_dir"], "merged.json"), merged, opts)
    return merged


def full(shard: dict, *, max_count: int, max_bytes: int) -> bool:
    """Whether a shard (a manifest entry) is full: it holds ``max_count`` samples, or one more sample of its mean
    size would pass ``max_bytes``."""
    count, size = shard["count"], shard["bytes"]
    return count >= max_count or size + size / max(1, count) > max_bytes


def commit(job: dict, markers: list[dict], *, skipped: int = 0, ignored: int = 0) -> dict:
    """Merge the tails (every partition's last shard that is not :func:`full`), in order, into full shards placed
    after the others, so that at most one shard is short; rename parts to dense final names, write the
    manifest; idempotent.

    ``skipped``: input items left out as unreadable; ``ignored``: input files the source kind does not
    read (the manifest records the counts; report.json lists them).
    """
    opts = job["storage_options"]
    fs, out_path = filesystem(job["out"], opts)
    plan = read_json(join_url(job["job_dir"], "commit.json"), opts)
    if plan is None:
        keep, tails = [], []
        for m in markers:
            for i, s in enumerate(m["shards"]):
                tail = i == len(m["shards"]) - 1 and not full(s, max_count=job["max_count"], max_bytes=job["max_bytes"])
                (tails if tail else keep).append((m["partition"], i, dict(s, dir="parts")))
        ordered = [s for _, _, s in keep]  # partition order; the short shard last
        ordered += _merge_tails(job, [s for _, _, s in tails]) if len(tails) >= 2 else [s for _, _, s in tails]
        plan = [dict(s, src=join_url(s.pop("dir"), s["name"]), name=job["pattern"] % i) for i, s in enumerate(ordered)]
        write_json(join_url(job["job_dir"], "commit.json"), plan, opts)
    jpath = filesystem(job["job_dir"], opts)[1]
    for entry in plan:
        src, dst = posixpath.join(jpath, entry["src"]), posixpath.join(out_path, entry["name"])
        _move(fs, src, dst)
        if job["index"]:
            _move(fs, _idx(src), _idx(dst))
    shards = [{k: e[k] for k in ("name", "count", "bytes", "sha256")} for e in plan]
    problems = verify_shards(job["out"], [dict(s, written=e.get("written")) for s, e in zip(shards, plan)], opts,
                             run=job.get("run"))
    if problems:
        raise DataError(f"commit of {job['out']} failed: {len(problems)} of {counted(len(shards), 'shard')} "
                        f"{'is' if len(problems) == 1 else 'are'} not as written "
                        f"({'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}); no manifest was written. "
                        "Rerun the same command to rebuild them")
    extra: dict[str, Any] = {"source": {"kind": job["kind"], "url": job["src"]}, "num_skipped": skipped,
                             "num_ignored": ignored, "check_images": job["check_images"]}
    if job["classes"]:
        extra["classes"] = job["classes"]
        write_json(join_url(job["out"], "classes.json"), job["classes"], opts)
    manifest = make_manifest(shards, **extra)
    write_manifest(job["out"], manifest, storage_options=opts)
    return manifest
