"""The inputs of ``datapipe shard``, cut into partitions: image folders, CSV/JSONL lists, JSONL/Parquet text, tars.

:func:`open_source` lists an input once (names and sizes, never contents) and cuts it into
*partitions*: small picklable dicts that :func:`iter_partition` reads back, in any process or on
any Ray worker. A partition yields :class:`Record` s in a fixed order: the raw sample, or the
name of an unreadable item and why. Partitioning depends only on the input and the options,
never on the number of workers, so every engine produces the same shards. Listing lives in
:mod:`datapipe.jobs.shard.listing`, reading partitions back in :mod:`datapipe.jobs.shard.readers`.

- image folder: files with an image extension; class sub-folders give ``cls`` (index of the
  class name in sorted order). Keys are the relative paths without extension.
- list (``.csv`` with a header naming ``path`` and ``label`` columns, or ``.jsonl`` records with
  those fields): paths relative to the list file; integer labels are kept, names are indexed in
  sorted order (of the rows kept). In a list with labels, a row without one is skipped; a list
  without a label column gives samples without ``cls``. A label is a CSV cell's text, or in JSONL a
  string or an integer; a JSONL row whose label is a float, a boolean, a list or an object is skipped.
- text (``.jsonl`` / ``.parquet`` files, or a folder of them): one sample per record with a ``txt``
  entry; JSONL is split into byte ranges, Parquet into row groups.
- tar (``.tar`` files, brace specs, or a folder of them): the samples as they are, re-sharded.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
import random
from dataclasses import dataclass, field
from typing import Any

from datapipe.jobs.shard.listing import (IMAGE_EXTENSIONS, TAR_EXTENSIONS, TEXT_EXTENSIONS, detect_kind, expand_tars,
                                         list_file_list, list_files, list_image_folder, make_key, parquet_row_groups)
from datapipe.jobs.shard.readers import Record, iter_partition, read_item
from datapipe.order.seeds import derive_seed
from datapipe.storage.files import filesystem
from datapipe.words import counted

__all__ = ["IMAGE_EXTENSIONS", "KINDS", "Record", "Source", "detect_kind", "iter_partition", "make_key",
           "open_source", "read_item"]

KINDS = ("auto", "images", "list", "text", "tar")


@dataclass
class Source:
    """A listed input: what it is, its partitions, and facts for the manifest and the job fingerprint."""

    kind: str
    url: str
    partitions: list[dict]
    classes: list[str] | None
    num_items: int | None
    fingerprint: str
    skipped: list[dict]
    ignored: list[str] = field(default_factory=list)  # files in the input that this kind does not read


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


WHOLE_SHARD_PARTITIONS = 16  # from this many shards' worth of input on, a partition is one or two whole shards


def _auto_partition_items(sizes: list[int], max_bytes: int, max_count: int) -> int:
    """Items per partition. An input of many shards' worth (by input sizes) is cut into whole shards' worth: one
    or two shards' items a partition, so that a partition's last shard is full too (but for skipped items);
    a smaller input into at least 64 partitions of 64 to 20000 items, whose shards the commit merges into
    full shards. A partition writes its own shards, so a shard never holds more."""
    mean = max(1.0, sum(sizes) / max(1, len(sizes)))
    per_shard = min(max_count, max(1, int(max_bytes / (mean + 1024))))
    if len(sizes) >= WHOLE_SHARD_PARTITIONS * per_shard:
        return per_shard * max(1, min(2, len(sizes) // (64 * per_shard)))
    return max(64, min(20000, 2 * per_shard, len(sizes) // 64))


def open_source(
    url: str,
    *,
    kind: str = "auto",
    text_field: str | None = None,
    key_field: str | None = None,
    path_field: str = "path",
    label_field: str = "label",
    partition_size: int | None = None,
    partition_bytes: int = 32 << 20,
    max_bytes: int = 1 << 30,
    max_count: int = 100_000,
    shuffle: bool = False,
    seed: int = 0,
    fill_shards: bool = False,
    storage_options: dict | None = None,
) -> Source:
    """List ``url`` and cut it into partitions (see the module docstring). Raises ValueError when empty.

    ``fill_shards``: the job copies image bytes unchanged, so an image folder is cut into partitions
    of exactly one shard each (by the writer's own size rule): no partition leaves a small tail.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if partition_size is not None and partition_size < 1:
        raise ValueError("partition_size must be >= 1 (or None for automatic)")
    url = url.rstrip("/") if "://" not in url or url.count("/") > 2 else url
    if "{" not in url and "::" not in url:
        fs, path = filesystem(url, storage_options)
        if not fs.exists(path):
            raise ValueError(f"input {url!r} does not exist")
    if kind == "auto":
        kind = detect_kind(url, storage_options=storage_options, text_field=text_field)
    common = dict(storage_options=storage_options or {})
    if kind in ("images", "list"):
        ignored: list[str] = []
        if kind == "images":
            items, classes, skipped, sizes, ignored = list_image_folder(url, storage_options)
        else:
            items, classes, skipped, sizes = list_file_list(url, path_field, label_field, storage_options)
        if not items:
            why = (f"{counted(len(skipped), 'item')} skipped, e.g. {skipped[0]['item']}: {skipped[0]['error']}"
                   if skipped else "")
            if ignored:
                why += ("; " if why else "") + f"{counted(len(ignored), 'file')} without an image extension, e.g. " + \
                    ", ".join(posixpath.basename(n) for n in ignored[:3])
            raise ValueError(f"no images found in {url!r}" + (f" ({why})" if why else ""))
        fp = _fingerprint(kind, items, sizes)
        if shuffle:
            order = list(range(len(items)))
            random.Random(derive_seed(seed, 0, "items")).shuffle(order)
            items, sizes = [items[i] for i in order], [sizes[i] for i in order]
        if partition_size is None and fill_shards and kind == "images":
            chunks = _shard_chunks(items, sizes, max_bytes, max_count)
        else:
            chunks = _chunks(items, partition_size or _auto_partition_items(sizes, max_bytes, max_count))
        parts = [{"kind": "images", "items": chunk, **common} for chunk in chunks]
        return Source(kind, url, _number(parts, shuffle, seed), classes, len(items), fp, skipped, ignored)
    if kind == "text":
        files, ignored = list_files(url, TEXT_EXTENSIONS, storage_options)
        parts, sizes = [], []
        for fi, (f, size) in enumerate(files):
            sizes.append(size)
            if f.endswith(".parquet"):
                parts += [{"kind": "parquet", "url": f, "file": fi, "row_group": g, **common}
                          for g in range(parquet_row_groups(f, storage_options))]
            else:
                parts += [{"kind": "jsonl", "url": f, "file": fi, "start": s, "end": min(size, s + partition_bytes),
                           **common} for s in range(0, max(size, 1), partition_bytes)]
        for p in parts:
            p.update(text_field=text_field or "text", key_field=key_field)
        fp = _fingerprint(kind, files, text_field, key_field, partition_bytes)
        return Source(kind, url, _number(parts, shuffle, seed), None, None, fp, [], ignored)
    files, ignored = list_files(url, TAR_EXTENSIONS, storage_options) if "{" not in url and "::" not in url \
        else (expand_tars(url, storage_options), [])
    expected = _manifest_counts([f for f, _ in files], storage_options)
    parts = [{"kind": "tar", "url": f, **common, **({"expected": expected[f]} if f in expected else {})}
             for f, _ in files]
    fp = _fingerprint(kind, files)
    return Source("tar", url, _number(parts, shuffle, seed), None, None, fp, [], ignored)


def _manifest_counts(urls: list[str], storage_options) -> dict[str, int]:
    """Samples per input tar from the ``manifest.json`` beside it (datapipe's shards have one): what a truncated tar
    should have held, so the job counts the samples lost with its cut. ``{}`` where there is none."""
    from datapipe.errors import DataError
    from datapipe.tar.manifest import read_manifest

    by_folder: dict[str, list[str]] = {}
    for u in urls:
        by_folder.setdefault(posixpath.dirname(u), []).append(u)
    counts: dict[str, int] = {}
    for folder, members in sorted(by_folder.items()):
        try:
            manifest = read_manifest(folder, storage_options=storage_options, retries=1)
            named = {s["name"]: int(s["count"]) for s in (manifest or {}).get("shards") or []}
        except (DataError, KeyError, TypeError, ValueError):
            continue  # an unreadable manifest, or not datapipe's: nothing expected
        counts.update({u: named[posixpath.basename(u)] for u in members if posixpath.basename(u) in named})
    return counts


def _shard_chunks(items: list, sizes: list[int], max_bytes: int, max_count: int) -> list[list]:
    """Cut image items where :class:`datapipe.ShardWriter` would start a new shard (same size rule)."""
    from datapipe.tar.writer import _tar_size

    chunks: list[list] = []
    current: list = []
    estimate = 0
    for item, size in zip(items, sizes):
        member = 512 + (size + 511) // 512 * 512 + (1024 if item[1] is not None else 0)
        if current and (len(current) >= max_count or _tar_size(estimate + member) > max_bytes):
            chunks.append(current)
            current, estimate = [], 0
        current.append(item)
        estimate += member
    if current:
        chunks.append(current)
    return chunks


def _number(parts: list[dict], shuffle: bool, seed: int) -> list[dict]:
    """Give partitions their index (output order); shuffling permutes them and seeds their inner shuffle.

    Seeds follow the one seed rule (:func:`datapipe.order.seeds.derive_seed`): one stream for the
    partition order, one for each partition's shuffle buffer (by its place in the listing).
    """
    order = list(range(len(parts)))
    if shuffle:
        random.Random(derive_seed(seed, 0, "partitions")).shuffle(order)
    out = []
    for index, i in enumerate(order):
        p = dict(parts[i], index=index)
        p["shuffle_seed"] = derive_seed(seed, 0, i, "buffer") if shuffle else None
        out.append(p)
    return out
