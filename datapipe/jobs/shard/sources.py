"""Input readers for ``datapipe shard``: image folders, CSV/JSONL lists of ``path,label``, JSONL/Parquet text, tars.

:func:`open_source` lists an input once (names and sizes, never contents) and cuts it into
*partitions*: small picklable dicts that :func:`iter_partition` reads back, in any process or on
any Ray worker. A partition yields :class:`Record` s in a fixed order: the raw sample, or the
name of an unreadable item and why. Partitioning depends only on the input and the options,
never on the number of workers, so every engine produces the same shards.

- image folder: files with an image extension; class sub-folders give ``cls`` (index of the
  class name in sorted order). Keys are the relative paths without extension.
- list (``.csv`` with a header naming ``path`` and ``label`` columns, or ``.jsonl`` records with
  those fields): paths relative to the list file; integer labels are kept, names are indexed in
  sorted order.
- text (``.jsonl`` / ``.parquet`` files, or a folder of them): one sample per record with a ``txt``
  entry; JSONL is split into byte ranges, Parquet into row groups.
- tar (``.tar`` files, brace specs, or a folder of them): the samples as they are, re-sharded.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import posixpath
import random
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from datapipe.order.seeds import derive_seed
from datapipe.order.shuffle import ShuffleBuffer
from datapipe.storage.files import filesystem

IMAGE_EXTENSIONS = {"jpg": "jpg", "jpeg": "jpg", "png": "png", "webp": "webp", "bmp": "bmp", "gif": "gif",
                    "tif": "tiff", "tiff": "tiff", "ppm": "ppm"}
TEXT_EXTENSIONS = (".jsonl", ".json", ".ndjson", ".parquet")
TAR_EXTENSIONS = (".tar", ".tar.gz", ".tgz")
KINDS = ("auto", "images", "list", "text", "tar")
_UNSAFE_KEY = re.compile(r"[^A-Za-z0-9_\-/]")


@dataclass
class Record:
    """One input item: ``sample`` (a dict with ``__key__``) or, when unreadable, ``error`` naming why."""

    name: str
    sample: dict | None = None
    error: str | None = None


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


def _join(root: str, rel: str) -> str:
    return rel if "://" in rel or rel.startswith("/") else posixpath.join(root, rel)


def _protocol_prefix(url: str) -> str:
    return url.split("://", 1)[0] + "://" if "://" in url else ""


def make_key(rel: str) -> str:
    """A webdataset key from a relative path: extension dropped, dots and odd characters -> ``_``."""
    stem = rel.rsplit(".", 1)[0] if "." in posixpath.basename(rel) else rel
    return _UNSAFE_KEY.sub("_", stem.strip("/")) or "_"


def detect_kind(url: str, *, storage_options: dict | None = None, text_field: str | None = None) -> str:
    """Guess the input kind from the URL and, for folders, from the files in them."""
    if "{" in url or "::" in url or url.endswith(TAR_EXTENSIONS):
        return "tar"
    if url.endswith(".csv"):
        return "list"
    if url.endswith(".parquet"):
        return "text"
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        raise ValueError(f"input {url!r} does not exist")
    if url.endswith((".jsonl", ".json", ".ndjson")):
        if text_field is not None:
            return "text"
        with fs.open(path, "rb") as f:
            first = f.readline()
        try:
            rec = json.loads(first)
        except ValueError:
            return "text"
        return "list" if isinstance(rec, dict) and "path" in rec and "text" not in rec else "text"
    if not fs.isdir(path):
        raise ValueError(f"cannot tell what {url!r} is from its name: give a folder, a .csv/.jsonl/.parquet/.tar "
                         "file, or --input-kind")
    names = list(_find(fs, path))
    if any(n.endswith(TAR_EXTENSIONS) for n in names):
        return "tar"
    if any(n.endswith(TEXT_EXTENSIONS) for n in names) and not any(_image_ext(n) for n in names):
        return "text"
    return "images"


def _find(fs, path: str, *, withdirs: bool = False) -> dict[str, dict]:
    """``fs.find(path, detail=True)``; on a local disk through ``os.scandir`` (one stat per file, a few
    times faster than fsspec's walk on large folders). Symbolic links are followed, as fsspec does."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return fs.find(path, detail=True, withdirs=withdirs)
    import os

    found: dict[str, dict] = {}
    todo = [path]
    while todo:
        current = todo.pop()
        with os.scandir(current) as entries:
            for e in entries:
                name = posixpath.join(current, e.name)
                if e.is_dir():
                    todo.append(name)
                    if withdirs:
                        found[name] = {"type": "directory", "size": 0}
                else:
                    try:
                        found[name] = {"type": "file", "size": e.stat().st_size}
                    except FileNotFoundError:  # a dangling link: fsspec lists it too
                        found[name] = {"type": "file", "size": 0}
    return dict(sorted(found.items()))


def _image_ext(name: str) -> str | None:
    base = posixpath.basename(name)
    if base.startswith(".") or "." not in base:
        return None
    return IMAGE_EXTENSIONS.get(base.rsplit(".", 1)[1].lower())


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _auto_partition_items(sizes: list[int], max_bytes: int, max_count: int) -> int:
    """Items per partition: about two shards' worth (from input sizes), fewer when that gives under 64 partitions;
    always within [64, 20000] items. A partition writes its own shards, so a shard never holds more."""
    mean = max(1.0, sum(sizes) / max(1, len(sizes)))
    per_shard = min(max_count, max(1, int(max_bytes / (mean + 1024))))
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
            items, classes, skipped, sizes, ignored = _list_image_folder(url, storage_options)
        else:
            items, classes, skipped, sizes = _list_file_list(url, path_field, label_field, storage_options)
        if not items:
            why = f"{len(skipped)} items skipped, e.g. {skipped[0]['item']}: {skipped[0]['error']}" if skipped else ""
            if ignored:
                why += ("; " if why else "") + f"{len(ignored)} files without an image extension, e.g. " + \
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
        files, ignored = _list_files(url, TEXT_EXTENSIONS, storage_options)
        parts, sizes = [], []
        for fi, (f, size) in enumerate(files):
            sizes.append(size)
            if f.endswith(".parquet"):
                parts += [{"kind": "parquet", "url": f, "file": fi, "row_group": g, **common}
                          for g in range(_parquet_row_groups(f, storage_options))]
            else:
                parts += [{"kind": "jsonl", "url": f, "file": fi, "start": s, "end": min(size, s + partition_bytes),
                           **common} for s in range(0, max(size, 1), partition_bytes)]
        for p in parts:
            p.update(text_field=text_field or "text", key_field=key_field)
        fp = _fingerprint(kind, files, text_field, key_field, partition_bytes)
        return Source(kind, url, _number(parts, shuffle, seed), None, None, fp, [], ignored)
    files, ignored = _list_files(url, TAR_EXTENSIONS, storage_options) if "{" not in url and "::" not in url \
        else (_expand_tars(url, storage_options), [])
    parts = [{"kind": "tar", "url": f, **common} for f, _ in files]
    fp = _fingerprint(kind, files)
    return Source("tar", url, _number(parts, shuffle, seed), None, None, fp, [], ignored)


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


# files that sit beside shards by design: not reported as ignored input
_COMPANIONS = ("manifest.json", "classes.json", "report.json")


def _list_files(url: str, extensions: tuple, storage_options) -> tuple[list[tuple[str, int]], list[str]]:
    """The files of ``url`` with one of ``extensions`` (name, size), and the other files it holds (ignored)."""
    fs, path = filesystem(url, storage_options)
    prefix = _protocol_prefix(url)
    ignored: list[str] = []
    if fs.isdir(path):
        found = _find(fs, path)
        files = []
        for n, info in sorted(found.items()):
            rel = posixpath.relpath(n, path)
            if any(part.startswith(".") for part in rel.split("/")):
                continue
            if n.endswith(extensions):
                files.append((n, int(info.get("size") or 0)))
            elif not (n.endswith(".idx") or posixpath.basename(n) in _COMPANIONS):
                ignored.append(rel)
    elif fs.exists(path):
        files = [(path, int(fs.info(path).get("size") or 0))]
    else:
        raise ValueError(f"input {url!r} does not exist")
    if not files:
        what = f" (it holds {len(ignored)} other files, e.g. {', '.join(ignored[:3])})" if ignored else ""
        raise ValueError(f"no {'/'.join(extensions)} files found in {url!r}{what}")
    return [(prefix + n if prefix and not n.startswith(prefix) else n, s) for n, s in files], ignored


def _expand_tars(url: str, storage_options) -> list[tuple[str, int]]:
    from datapipe.storage.urls import expand_urls

    urls = expand_urls(url)
    local = [u for u in urls if "://" not in u or u.startswith("file://")]
    if urls and len(local) == len(urls) and not any(_exists(u, storage_options) for u in local):
        raise ValueError(f"no file matches {url!r} ({len(urls)} names, e.g. {urls[0]!r}; none exists)")
    return [(u, 0) for u in urls]


def _exists(url: str, storage_options) -> bool:
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def _list_image_folder(url: str, storage_options):
    fs, root = filesystem(url, storage_options)
    if not fs.isdir(root):
        raise ValueError(f"image folder {url!r} does not exist or is not a folder")
    found = _find(fs, root, withdirs=True)
    files, dirs = {}, set()
    for name, info in found.items():
        rel = posixpath.relpath(name, root)
        if rel == "." or any(part.startswith(".") for part in rel.split("/")):
            continue
        if info.get("type") == "directory":
            dirs.add(rel.split("/")[0])
        else:
            files[rel] = int(info.get("size") or 0)
            if "/" in rel:
                dirs.add(rel.split("/")[0])
    classes = sorted(dirs) or None
    class_index = {c: i for i, c in enumerate(classes or [])}
    items, skipped, sizes, keys, used, ignored = [], [], [], set(), set(), []
    for rel in sorted(files):
        ext = _image_ext(rel)
        if ext is None:
            ignored.append(rel)
            continue
        if classes and "/" not in rel:
            skipped.append({"item": _join(url, rel), "error": "image outside the class folders"})
            continue
        label = class_index[rel.split("/")[0]] if classes else None
        key = _unique(make_key(rel), keys)
        items.append([_join(url, rel), label, key, ext])
        sizes.append(files[rel])
        if label is not None:
            used.add(label)
    for c in classes or []:
        if class_index[c] not in used:
            skipped.append({"item": _join(url, c), "error": "class folder holds no images"})
    return items, classes, skipped, sizes, ignored


def _unique(key: str, keys: set) -> str:
    out, n = key, 1
    while out in keys:
        out, n = f"{key}_{n}", n + 1
    keys.add(out)
    return out


def _list_file_list(url: str, path_field: str, label_field: str, storage_options):
    fs, path = filesystem(url, storage_options)
    base = posixpath.dirname(url)
    rows: list[tuple[str, Any]] = []
    skipped: list[dict] = []
    with fs.open(path, "rb") as f:
        raw = f.read()
    if url.endswith(".csv"):
        text = raw.decode("utf-8", errors="replace")
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or path_field not in reader.fieldnames:
            raise ValueError(f"{url}: the CSV needs a header row with a {path_field!r} column "
                             f"(and optionally {label_field!r}); found {reader.fieldnames}")
        rows = [(r[path_field], r.get(label_field)) for r in reader]
    else:
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
                rows.append((rec[path_field], rec.get(label_field)))
            except (ValueError, KeyError, TypeError) as e:
                skipped.append({"item": f"{url}:{n}", "error": f"bad list line: {type(e).__name__}: {e}"})
    labels = [lab for _, lab in rows if lab not in (None, "")]
    numeric = all(re.fullmatch(r"-?\d+", str(lab).strip()) for lab in labels)
    classes = None if numeric or not labels else sorted({str(lab) for lab in labels})
    index = {c: i for i, c in enumerate(classes or [])}
    items, sizes, keys = [], [], set()
    for rel, lab in rows:
        ext = _image_ext(rel) or "jpg"
        label = None if lab in (None, "") else (int(str(lab).strip()) if numeric else index[str(lab)])
        items.append([_join(base, rel), label, _unique(make_key(rel), keys), ext])
        sizes.append(0)
    return items, classes, skipped, sizes


def _parquet_row_groups(url: str, storage_options) -> int:
    from datapipe.extras import require

    pq = require("pyarrow.parquet", what="reading Parquet")
    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_row_groups


# ---- reading partitions --------------------------------------------------------------------


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
    found = 0
    try:
        for event in iter_samples(reader_for(f, seekable=seekable), url, resync=True):
            name = f"{url}#{event.key or '?'}"
            found += 1
            if event.sample is None:
                yield Record(name, error=f"damaged sample: {event.error}")
                continue
            yield Record(name, {k: (bytes(v) if isinstance(v, memoryview) else v)
                                for k, v in event.sample.items() if k != "__url__"})
        missing_end = _lacks_end_of_archive(url, part.get("storage_options"))
    except (TarFormatError, OSError, EOFError, DataError) as e:
        yield Record(url, error=f"unreadable tar (truncated?): {e}")
        return
    finally:
        f.close()
    if missing_end and not found:
        yield Record(url, error="not a tar file (or one cut before its first sample)")
    elif missing_end:
        yield Record(url, error="tar has no end-of-archive block: truncated (samples before the cut were kept)")


def _lacks_end_of_archive(url: str, storage_options) -> bool:
    """True when an uncompressed tar does not end in a zero block (it was cut short)."""
    if url.endswith((".gz", ".tgz")):
        return False  # gzip notices truncation itself (EOFError)
    fs, path = filesystem(url, storage_options)
    size = fs.size(path)
    if size is None:
        return False
    return size % 512 != 0 or size < 1024 or fs.cat_file(path, start=size - 512, end=size) != bytes(512)
