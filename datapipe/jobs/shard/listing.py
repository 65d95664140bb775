"""Listing an input of ``datapipe shard``: its names and sizes, never its contents.

:func:`detect_kind` tells what an input is; the ``list_*`` functions list an image folder, a
CSV/JSONL list of ``path,label``, the text or tar files of a folder, or a brace spec of tars.
Keys come from relative paths (:func:`make_key`), unique within the input.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import posixpath
import re
from typing import Any

from datapipe.jobs.shard.usage import UsageError
from datapipe.storage.files import filesystem
from datapipe.tar.manifest import SIDECAR_NAME
from datapipe.words import counted

IMAGE_EXTENSIONS = {"jpg": "jpg", "jpeg": "jpg", "png": "png", "webp": "webp", "bmp": "bmp", "gif": "gif",
                    "tif": "tiff", "tiff": "tiff", "ppm": "ppm"}
TEXT_EXTENSIONS = (".jsonl", ".json", ".ndjson", ".parquet")
TAR_EXTENSIONS = (".tar", ".tar.gz", ".tgz")
_UNSAFE_KEY = re.compile(r"[^A-Za-z0-9_\-/]")

log = logging.getLogger("datapipe.jobs.shard.listing")


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
        hint = (ONE_IMAGE if image_ext(url) else "give a folder, a .csv/.jsonl/.parquet/.tar file, or --input-kind")
        raise UsageError(f"cannot tell what {url!r} is from its name: {hint}")
    names = list(find(fs, path))
    if any(n.endswith(TAR_EXTENSIONS) for n in names):
        return "tar"
    if any(n.endswith(TEXT_EXTENSIONS) for n in names) and not any(image_ext(n) for n in names):
        return "text"
    return "images"


def find(fs, path: str, *, withdirs: bool = False) -> dict[str, dict]:
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


ONE_IMAGE = "for one image, put it in a class folder (SRC/CLASS/name.jpg) and give SRC"


def image_ext(name: str) -> str | None:
    base = posixpath.basename(name)
    if base.startswith(".") or "." not in base:
        return None
    return IMAGE_EXTENSIONS.get(base.rsplit(".", 1)[1].lower())


# files that sit beside shards by design: not reported as ignored input
_COMPANIONS = ("manifest.json", SIDECAR_NAME, "classes.json", "report.json")


def list_files(url: str, extensions: tuple, storage_options) -> tuple[list[tuple[str, int]], list[str]]:
    """The files of ``url`` with one of ``extensions`` (name, size), and the other files it holds (ignored)."""
    fs, path = filesystem(url, storage_options)
    prefix = _protocol_prefix(url)
    ignored: list[str] = []
    if fs.isdir(path):
        found = find(fs, path)
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


def expand_tars(url: str, storage_options) -> list[tuple[str, int]]:
    from datapipe.storage.urls import expand_urls

    urls = expand_urls(url)
    local = [u for u in urls if "://" not in u or u.startswith("file://")]
    if urls and len(local) == len(urls) and not any(_exists(u, storage_options) for u in local):
        raise ValueError(f"no file matches {url!r} ({len(urls)} names, e.g. {urls[0]!r}; none exists)")
    return [(u, 0) for u in urls]


def _exists(url: str, storage_options) -> bool:
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def list_image_folder(url: str, storage_options):
    fs, root = filesystem(url, storage_options)
    if not fs.isdir(root):
        raise ValueError(f"image folder {url!r} does not exist or is not a folder")
    found = find(fs, root, withdirs=True)
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
        ext = image_ext(rel)
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


_MISSING = object()  # a row without the field at all (a short CSV row, a JSONL record without the key)


def _list_rows(url: str, raw: bytes, path_field: str, label_field: str):
    """A list's rows as ``(line, path, label)``, its bad lines as ``(line, error)``, and whether it has labels:
    a CSV whose header names ``label_field``, a JSONL list of which a record has it."""
    rows: list[tuple[int, Any, Any]] = []
    bad: list[tuple[int, str]] = []
    if url.endswith(".csv"):
        text = raw.decode("utf-8-sig", errors="replace")  # a byte-order mark (spreadsheets write one) is not a name
        reader = csv.DictReader(io.StringIO(text), restval=_MISSING)
        if not reader.fieldnames or path_field not in reader.fieldnames:
            raise ValueError(f"{url}: the CSV needs a header row with a {path_field!r} column "
                             f"(and optionally {label_field!r}); found {reader.fieldnames}")
        rows = [(reader.line_num, r[path_field], r.get(label_field, _MISSING)) for r in reader]
        return rows, bad, label_field in reader.fieldnames
    labeled = False
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8-sig" if n == 1 else "utf-8"))
            rows.append((n, rec[path_field], rec.get(label_field, _MISSING)))
        except (ValueError, KeyError, TypeError) as e:
            bad.append((n, f"bad list line: {type(e).__name__}: {e}"))
            continue
        labeled = labeled or label_field in rec
    return rows, bad, labeled


def _row_problem(rel: Any, lab: Any, labeled: bool, path_field: str, label_field: str) -> str | None:
    """Why a list row cannot be written, or None: no path; in a list with labels, no label, or (JSONL) a label
    that is neither a class name (a string) nor a class index (an integer): a float, a boolean, a list or an
    object is never turned into a class name."""
    if rel is _MISSING or rel is None or (isinstance(rel, str) and not rel.strip()):
        return f"{'empty' if isinstance(rel, str) else 'missing'} {path_field!r}"
    if not isinstance(rel, str):
        return f"{path_field!r} is not a string: {rel!r}"
    if labeled and (lab is _MISSING or lab is None):
        return f"{rel}: missing {label_field!r} (the list has labels)"
    if labeled and isinstance(lab, str) and not lab.strip():
        return f"{rel}: empty {label_field!r} (the list has labels)"
    if labeled and (isinstance(lab, bool) or not isinstance(lab, (str, int))):
        kind = _JSON_KINDS.get(type(lab), type(lab).__name__)
        text = json.dumps(lab)
        text = text if len(text) <= 60 else text[:57] + "..."
        return (f"{rel}: {label_field!r} is {kind} ({text}), not a class name (a string) "
                f"or a class index (an integer)")
    return None


# what a JSONL label that is neither a string nor an integer is, in JSON's words
_JSON_KINDS = {list: "a list", dict: "an object", bool: "a boolean", float: "a float"}


def list_file_list(url: str, path_field: str, label_field: str, storage_options):
    """The items of a CSV/JSONL list. In a list with labels, a row without one is skipped (never written
    without ``cls``); labels are indexed from the rows kept: integers as they are, names in sorted order."""
    fs, path = filesystem(url, storage_options)
    base = posixpath.dirname(url)
    with fs.open(path, "rb") as f:
        raw = f.read()
    rows, bad, labeled = _list_rows(url, raw, path_field, label_field)
    kept: list[tuple[str, Any]] = []
    for n, rel, lab in rows:
        problem = _row_problem(rel, lab, labeled, path_field, label_field)
        if problem:
            bad.append((n, problem))
        else:
            kept.append((rel, lab if labeled else None))
    skipped = [{"item": f"{url}:{n}", "error": error} for n, error in sorted(bad)]
    kept = [(rel, None if lab is None else str(lab).strip()) for rel, lab in kept]  # " cat" and "cat" are one class
    labels = [lab for _, lab in kept if lab is not None]
    indices = [lab for lab in labels if re.fullmatch(r"-?\d+", lab)]
    numeric = len(indices) == len(labels)
    if indices and not numeric:
        names = next(lab for lab in labels if not re.fullmatch(r"-?\d+", lab))
        log.warning("the labels of %s mix class indices (%s, e.g. %r) and names (%s, e.g. %r): every label is "
                    "taken as a name, classes sorted as text (classes.json), so an index label does not keep its value",
                    url, counted(len(indices), "row"), indices[0], counted(len(labels) - len(indices), "row"), names)
    classes = None if numeric or not labels else sorted(set(labels))
    index = {c: i for i, c in enumerate(classes or [])}
    items, sizes, keys = [], [], set()
    for rel, lab in kept:
        ext = image_ext(rel) or "jpg"
        label = None if lab is None else (int(lab) if numeric else index[lab])
        items.append([_join(base, rel), label, _unique(make_key(rel), keys), ext])
        sizes.append(0)
    return items, classes, skipped, sizes


def parquet_row_groups(url: str, storage_options) -> int:
    from datapipe.extras import require

    pq = require("pyarrow.parquet", what="reading Parquet")
    fs, path = filesystem(url, storage_options)
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_row_groups
