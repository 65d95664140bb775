"""Reading partitions of ``datapipe shard`` back: the :class:`Record` s of one partition, in output order.

A partition (a picklable dict made by :func:`datapipe.jobs.shard.sources.open_source`) is read in
any process or on any Ray worker: image items, a JSONL byte range, a Parquet row group or a tar
shard. A record is the raw sample, or the name of an unreadable item and why.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Iterator

from datapipe.jobs.shard.listing import make_key
from datapipe.order.shuffle import ShuffleBuffer
from datapipe.storage.files import filesystem
from datapipe.words import counted


@dataclass
class Record:
    """One input item: ``sample`` (a dict with ``__key__``) or, when unreadable, ``error`` naming why; ``lost``:
    the samples that went with it beyond this one item (a truncated tar's cut, counted from its manifest)."""

    name: str
    sample: dict | None = None
    error: str | None = None
    lost: int = 0


def iter_partition(part: dict, *, shuffle_buffer: int = 1000) -> Iterator[Record]:
    """The records of one partition, in their output order (shuffled when the job shuffles)."""
    kind = part["kind"]
    if kind == "images":
        records = _iter_images(part)
    elif kind == "jsonl":
        records = _iter_jsonl(part)
    elif kind == "parquet":
        records = _iter_parquet(part)
    elif kind == "tar":
        records = _iter_tar(part)
    else:
        raise ValueError(f"unknown partition kind {kind!r}")
    seed = part.get("shuffle_seed")
    if seed is None or kind == "images":  # image items are shuffled globally at listing time
        return records
    return ShuffleBuffer(shuffle_buffer, random.Random(seed)).run(records)


def read_item(url: str, storage_options: dict | None = None) -> bytes:
    """The bytes of one input file (local files without fsspec's overhead)."""
    if "://" not in url or url.startswith("file://"):
        with open(url.removeprefix("file://"), "rb") as f:
            return f.read()
    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        return f.read()


def _iter_images(part: dict) -> Iterator[Record]:
    opts = part.get("storage_options") or {}
    for url, label, key, ext in part["items"]:
        try:
            data = read_item(url, opts)
        except (OSError, ValueError) as e:
            yield Record(url, error=f"cannot read: {type(e).__name__}: {e}")
            continue
        sample = {"__key__": key, ext: data}
        if label is not None:
            sample["cls"] = str(label).encode("ascii")
        yield Record(url, sample)


def _text_sample(rec: Any, key: str, part: dict) -> dict:
    if not isinstance(rec, dict):
        raise ValueError("record is not a JSON object")
    text = rec.get(part["text_field"])
    if not isinstance(text, str):
        raise ValueError(f"record has no string field {part['text_field']!r}")
    if part.get("key_field"):
        if rec.get(part["key_field"]) in (None, ""):
            raise ValueError(f"record has no key field {part['key_field']!r}")
        key = make_key(str(rec[part["key_field"]]) + ".x")
    return {"__key__": key, "txt": text}


def _iter_jsonl(part: dict) -> Iterator[Record]:
    fs, path = filesystem(part["url"], part.get("storage_options"))
    start, end, fi = part["start"], part["end"], part["file"]
    with fs.open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line that straddles ``start`` belongs to the previous partition
        while True:
            offset = f.tell()
            if offset >= end:
                return
            line = f.readline()
            if not line:
                return
            if not line.strip():
                continue
            name = f"{part['url']}@{offset}"
            try:
                rec = json.loads(line.decode("utf-8"))
                yield Record(name, _text_sample(rec, f"{fi:05d}_{offset:012d}", part))
            except UnicodeDecodeError as e:
                yield Record(name, error=f"line is not UTF-8: {e}")
            except ValueError as e:
                yield Record(name, error=f"bad JSON line: {e}")


def _iter_parquet(part: dict) -> Iterator[Record]:
    import pyarrow.parquet as pq

    fs, path = filesystem(part["url"], part.get("storage_options"))
    group, fi = part["row_group"], part["file"]
    with fs.open(path, "rb") as f:
        try:
            table = pq.ParquetFile(f).read_row_group(group)
        except Exception as e:  # pyarrow raises its own types for damaged files
            yield Record(f"{part['url']}#rowgroup={group}", error=f"cannot read row group: {e}")
            return
    for i, rec in enumerate(table.to_pylist()):
        name = f"{part['url']}#rowgroup={group}&row={i}"
        try:
            yield Record(name, _text_sample(rec, f"{fi:05d}_{group:06d}_{i:08d}", part))
        except ValueError as e:
            yield Record(name, error=str(e))


def _iter_tar(part: dict) -> Iterator[Record]:
    from datapipe.errors import DataError
    from datapipe.storage.files import open_shard
    from datapipe.tar.blocks import reader_for
    from datapipe.tar.headers import TarFormatError
    from datapipe.tar.reader import iter_samples

    url = part["url"]
    try:
        f, seekable = open_shard(url, storage_options=part.get("storage_options"))
    except DataError as e:
        yield Record(url, error=str(e))
        return
    found = kept = 0
    try:
        for event in iter_samples(reader_for(f, seekable=seekable), url, resync=True):
            name = f"{url}#{event.key or '?'}"
            found += 1
            kept += event.sample is not None
            if event.sample is None:
                yield Record(name, error=f"damaged sample: {event.error}")
                continue
            yield Record(name, {k: (bytes(v) if isinstance(v, memoryview) else v)
                                for k, v in event.sample.items() if k != "__url__"})
        missing_end = _lacks_end_of_archive(url, part.get("storage_options"))
    except (TarFormatError, OSError, EOFError, DataError) as e:
        yield _cut(part, f"unreadable tar (truncated?): {e}", found, kept)
        return
    finally:
        f.close()
    if missing_end and not found:
        yield Record(url, error="not a tar file (or one cut before its first sample)")
    elif missing_end:
        yield _cut(part, "tar has no end-of-archive block: truncated (samples before the cut were kept)", found, kept)


def _cut(part: dict, why: str, found: int, kept: int) -> Record:
    """The record of a tar that ended early after ``found`` samples (``kept`` of them whole): with the count its
    manifest gave (``part["expected"]``), how many it kept and lost; ``lost``: those never read at all."""
    expected = part.get("expected")
    if expected is None:
        return Record(part["url"], error=why)
    lost = max(0, expected - found)
    damaged = found - kept
    return Record(part["url"], error=f"{why}: {kept} of the manifest's {counted(expected, 'sample')} kept; "
                  f"{lost} never read"
                  + (f", {damaged} damaged (listed apart)" if damaged else ""), lost=lost)


def _lacks_end_of_archive(url: str, storage_options) -> bool:
    """True when an uncompressed tar does not end in a zero block (it was cut short)."""
    if url.endswith((".gz", ".tgz")):
        return False  # gzip notices truncation itself (EOFError)
    fs, path = filesystem(url, storage_options)
    size = fs.size(path)
    if size is None:
        return False
    return size % 512 != 0 or size < 1024 or fs.cat_file(path, start=size - 512, end=size) != bytes(512)
