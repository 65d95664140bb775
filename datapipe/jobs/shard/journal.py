"""The job directory ``OUT/.datapipe-job`` of ``datapipe shard``: its layout and atomic JSON files.

``config.json`` (the job's options and whether it completed), ``parts/part-<p>-<n>.tar`` (part shards),
``done/p<p>.json`` (done markers), and the commit's ``merged/``, ``merged.json`` and ``commit.json``.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any

from datapipe.storage.files import filesystem, write_json  # noqa: F401 - write_json: the jobs' name for it

JOB_DIR = ".datapipe-job"


def join_url(directory: str, *names: str) -> str:
    """``directory/name/...`` for paths and URLs alike."""
    return posixpath.join(directory.rstrip("/"), *names)


def marker_url(job: dict, index: int) -> str:
    """Where partition ``index``'s done marker lives."""
    return join_url(job["job_dir"], "done", f"p{index:06d}.json")


def read_json(url: str, options: dict) -> Any | None:
    """The JSON at ``url``, or None when there is none."""
    fs, path = filesystem(url, options)
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def part_pattern(job: dict, index: int) -> str:
    """The ShardWriter pattern of partition ``index``'s part shards."""
    return join_url(job["job_dir"], "parts", f"part-{index:06d}-%06d.tar")


def clean_partition(job: dict, index: int) -> None:
    """Delete what a killed run left of partition ``index`` (part shards, temporary files, indexes)."""
    fs, path = filesystem(join_url(job["job_dir"], "parts"), job["storage_options"])
    if fs.exists(path):
        for p in fs.glob(posixpath.join(path, f"part-{index:06d}-*")):
            fs.rm(p)

