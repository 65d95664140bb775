"""``manifest.json``: the shard names, sample counts, sizes and checksums of a shard directory."""
from __future__ import annotations

import json
import os
import posixpath
import re
from operator import itemgetter, methodcaller
from typing import Any, Sequence

import fsspec
import numpy as np

from datapipe.tar.columns import ManifestColumns

MANIFEST_NAME = "manifest.json"
SIDECAR_NAME = "manifest.columns.npz"  # a large manifest's columns, written beside it (``write_sidecar``)
FORMAT = "datapipe-manifest"


def manifest_url(directory: str) -> str:
    return posixpath.join(directory.rstrip("/"), MANIFEST_NAME) if directory else MANIFEST_NAME


def make_manifest(shards: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A manifest dict for shard entries ``{"name", "count", "bytes", "sha256"}`` (sorted by name)."""
    shards = sorted(shards, key=lambda s: s["name"])
    return {
        "format": FORMAT,
        "version": 1,
        "num_samples": sum(s["count"] for s in shards),
        "num_bytes": sum(s["bytes"] for s in shards),
        "shards": shards,
        **extra,
    }


def write_manifest(directory: str, manifest: dict[str, Any], *, storage_options: dict | None = None) -> str:
    """Write ``<directory>/manifest.json`` atomically (temporary name, then rename), and for a large one its
    columns beside it (``manifest.columns.npz``, :func:`write_sidecar`)."""
    from datapipe.storage.files import write_json

    url = manifest_url(directory)
    data = write_json(url, manifest, storage_options)
    write_sidecar(directory, manifest, data, storage_options=storage_options)
    return url


def write_sidecar(directory: str, manifest: dict[str, Any], data: bytes, *,
                  storage_options: dict | None = None) -> None:
    """Beside a manifest of at least ``manifest_cache.MIN_BYTES`` (``data``: its JSON as written), its columns in
    ``manifest.columns.npz``, stamped with the JSON's size and sha256, so that even the first open of a
    million-shard manifest reads no JSON (:func:`read_columns`); beside a smaller one, none (an old one is
    removed). A sidecar that cannot be written is logged at debug level only: readers parse the JSON."""
    import hashlib
    import logging

    from datapipe.storage.files import filesystem
    from datapipe.tar import manifest_cache

    fs, path = filesystem(sidecar_url(directory), storage_options)
    try:
        if len(data) < manifest_cache.MIN_BYTES:
            if fs.exists(path):
                fs.rm(path)
            return
        columns = _columns_of(manifest)
        meta = {"manifest_size": len(data), "manifest_sha256": hashlib.sha256(data).hexdigest()}
        tmp = f"{path}.tmp-{os.getpid()}"
        with fs.open(tmp, "wb") as f:
            written = manifest_cache.write_file(f, meta, columns)
        if written:
            fs.mv(tmp, path)
        else:
            fs.rm(tmp)
    except Exception as e:  # a sidecar is only a shortcut
        logging.getLogger(__name__).debug("no columns sidecar for %s: %s", path, e)


def sidecar_url(directory: str) -> str:
    return posixpath.join(directory.rstrip("/"), SIDECAR_NAME) if directory else SIDECAR_NAME


def _from_sidecar(directory: str, size: int, storage_options: dict | None) -> ManifestColumns | None:
    """The columns of the manifest's sidecar, if there is one and it was written for the manifest as it is now
    (same size and sha256, the manifest streamed through the hash); else None."""
    import hashlib

    from datapipe.storage.files import filesystem
    from datapipe.tar import manifest_cache

    try:
        fs, path = filesystem(sidecar_url(directory), storage_options)
        with fs.open(path, "rb") as f:
            meta, columns = manifest_cache.read_file(f)
        if meta.get("manifest_size") != size:
            return None
        digest = hashlib.sha256()
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        fs, path = filesystem(manifest_url(directory), storage_options)
        with fs.open(path, "rb") as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                digest.update(view[:n])
        return columns if digest.hexdigest() == meta.get("manifest_sha256") else None
    except Exception:  # none, unreadable or foreign: the JSON decides
        return None


def read_manifest(directory: str, *, storage_options: dict | None = None, retries: int = 5,
                  backoff: float = 0.2) -> dict[str, Any] | None:
    """The manifest of a shard directory, or None when it has none. Transient failures are retried
    (``retries`` times, exponential backoff from ``backoff`` seconds). A manifest that cannot be read
    (no permission, wrong credentials, no connection, not JSON) is a ``DataError`` naming it."""

    def load(f):
        return json.load(f)

    manifest = _read(directory, load, "r", storage_options=storage_options, retries=retries, backoff=backoff)
    if manifest is not None:
        _check(manifest, manifest_url(directory))
    return manifest


def read_columns(directory: str, *, storage_options: dict | None = None, retries: int = 5,
                 backoff: float = 0.2, cache_dir: str | None = None) -> ManifestColumns | None:
    """What :func:`read_manifest` reads, as columns: the shard names, counts and checksums, without a dict per
    shard. The ``shards`` list is parsed a chunk of entries at a time, so a million-shard manifest needs tens
    of MB, not the ~300 MB its dicts would take; the other keys come whole (``ManifestColumns.head``). A large
    manifest's columns are also kept in a local copy (:mod:`datapipe.tar.manifest_cache`, in ``cache_dir``)
    that later reads of the unchanged manifest take instead of its JSON; its first read takes the columns
    that the writer left beside it (:func:`write_sidecar`) where they match it."""
    from datapipe.tar import manifest_cache

    cache_dir = cache_dir or manifest_cache.DEFAULT_DIR
    url = manifest_url(directory)
    mark = None
    try:
        from datapipe.storage.stamps import stamp

        mark = stamp(url, storage_options)
    except Exception:  # no manifest, or no access: the read below says which
        mark = None
    if mark is not None and (mark.get("size") or 0) >= manifest_cache.MIN_BYTES and mark.get("version"):
        columns = manifest_cache.load(url, mark, cache_dir)
        if columns is not None:
            return columns
        columns = _from_sidecar(directory, mark["size"], storage_options)
        if columns is not None:
            manifest_cache.store(url, mark, columns, cache_dir)
            return columns
    else:
        mark = None
    columns = _read(directory, _parse_columns, "rb", storage_options=storage_options, retries=retries,
                    backoff=backoff)
    if columns is not None and mark is not None:
        manifest_cache.store(url, mark, columns, cache_dir)
    return columns


def _read(directory: str, load, mode: str, *, storage_options, retries, backoff):
    from datapipe.errors import DataError
    from datapipe.storage.files import describe, retry_call, secrets_of
    from datapipe.storage.locations import redact_url

    url = manifest_url(directory)

    def attempt():
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        with fs.open(path, mode) as f:
            return load(f)

    try:
        return retry_call(attempt, url, retries=retries, backoff=backoff, storage_options=storage_options,
                          what="manifest")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except DataError:
        raise
    except Exception as e:
        text, cause = describe(e, secrets_of(url, storage_options))
        raise DataError(f"cannot read the manifest: {text}", url=redact_url(url), what="manifest") from cause


def _check(manifest: Any, url: str) -> None:
    from datapipe.errors import DataError
    from datapipe.storage.locations import redact_url

    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise DataError("not a datapipe manifest (no 'shards' list)", url=redact_url(url), what="manifest")


CHUNK = 1 << 20  # ~11k entries of a writer-made manifest per json.loads
_SHARDS_KEY = re.compile(rb'"shards"\s*:\s*\[')


def _parse_columns(f) -> ManifestColumns:
    """Columns from the open (binary) manifest ``f``: its head up to ``"shards": [``, then entries a chunk at a
    time, each chunk cut after an entry's ``}`` (a cut anywhere else is not valid JSON), then its tail. A
    manifest laid out otherwise is parsed whole."""
    buf = f.read(CHUNK)
    m = _SHARDS_KEY.search(buf)
    head = None
    if m is not None:
        try:
            head = json.loads(buf[:m.start()] + b'"shards": []}')
        except ValueError:
            head = None
    if not isinstance(head, dict):
        return _columns_of(json.loads(buf + f.read()))
    names: list[tuple[str, np.ndarray]] = []
    counts: list[int] = []
    checksums: list = []
    buf = buf[m.end():]
    while True:
        buf = buf.lstrip()
        if buf[:1] == b",":
            buf = buf[1:].lstrip()
        if buf[:1] == b"]":
            tail = (buf[1:] + f.read()).strip()
            if tail[:1] == b",":
                head.update(json.loads(b"{" + tail[1:]))
            elif tail != b"}":
                raise ValueError("not JSON after the shards list")
            break
        entries = None
        for cut in _cuts(buf):
            try:
                entries = json.loads(b"[" + buf[:cut] + b"]")
                break
            except ValueError:
                continue
        if entries is None:
            more = f.read(CHUNK)
            if not more:
                raise ValueError("the manifest's shards list does not end")
            buf += more
            continue
        _add(entries, names, counts, checksums)
        buf = buf[cut:]
    head["shards"] = []
    return ManifestColumns.of(head, names, counts, _flat(checksums))


def _cuts(buf: bytes, most: int = 4):
    """Up to ``most`` places to cut ``buf`` after an entry, last first: after a ``}`` that a ``,`` or a ``]``
    follows (whitespace between)."""
    end = len(buf)
    while most > 0:
        i = buf.rfind(b"}", 0, end)
        if i < 0:
            return
        nxt = buf[i + 1:i + 64].lstrip()[:1]
        if nxt in (b",", b"]"):
            most -= 1
            yield i + 1
        end = i


def _add(entries: list, names: list[str], counts: list[int], checksums: list) -> None:
    """Append a block of entries: its names joined into one string (with their lengths), its counts, and its
    checksums (a list per block, None for a block without any: see :func:`_flat`)."""
    try:
        block = list(map(itemgetter("name"), entries))
        joined = "\n".join(block)  # a TypeError unless every name is a string
        counts += map(int, map(itemgetter("count"), entries))
        sums = list(map(methodcaller("get", "sha256"), entries))
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"not a datapipe manifest: a shard entry without a name or count ({e})") from e
    checksums.append((sums if any(sums) else None, len(sums)))
    if block:
        names.append((joined, np.fromiter(map(len, block), dtype=np.int32, count=len(block))))


def _flat(checksums: list) -> list:
    """The checksums of :func:`_add`'s blocks as one list; empty where no block had any (a million shards without
    checksums: no list of a million Nones)."""
    if all(sums is None for sums, _ in checksums):
        return []
    return [v for sums, n in checksums for v in (sums if sums is not None else [None] * n)]


def _columns_of(manifest: Any) -> ManifestColumns:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise ValueError("not a datapipe manifest (no 'shards' list)")
    names: list[tuple[str, np.ndarray]] = []
    counts: list[int] = []
    checksums: list = []
    _add(manifest["shards"], names, counts, checksums)
    return ManifestColumns.of({**manifest, "shards": []}, names, counts, _flat(checksums))


def listed(urls, *, storage_options: dict | None = None, retries: int = 5,
           backoff: float = 0.2) -> tuple[list, Sequence | None, str | None] | None:
    """``(counts, checksums, fingerprint)`` aligned with ``urls`` (None where no manifest beside them lists a URL;
    checksums None where none has one; the shards' fingerprint where the manifest's copy knows it), when all of
    ``urls`` lie in one directory (a brace pattern's case); else None.

    The directory's manifest is read as columns (:func:`read_columns`); URLs that are exactly its shards in
    its order take its counts as they are, others are looked up by name.
    """
    if not len(urls):
        return None
    directory = posixpath.dirname(urls[0])
    prefix, k = directory + "/", len(directory) + 1
    quick = urls.in_folder() if hasattr(urls, "in_folder") else None  # a brace range: its names made directly
    if quick is not None:
        directory, joined = quick
    elif not all(u.startswith(prefix) for u in urls):
        return None
    else:
        joined = "\n".join(u[k:] for u in urls)
    if "/" in joined or joined.count("\n") != len(urls) - 1 or joined.startswith("pipe:"):
        return None
    columns = read_columns(directory, storage_options=storage_options, retries=retries, backoff=backoff)
    if columns is None:
        return [None] * len(urls), None, None
    if joined == columns.names:
        return columns.counts, columns.checksums, columns.fingerprint
    del joined
    from datapipe.storage.shard_list import ShardList

    index = {name: i for i, name in enumerate(ShardList(directory, columns.names, columns.starts).iter_names())}
    where = [index.get(u[k:]) for u in urls]
    del index
    counts = [None if i is None else columns.counts[i] for i in where]
    sums = None if columns.checksums is None else [None if i is None else columns.checksums[i] or None
                                                   for i in where]
    return counts, sums, None


def counts_from_manifests(urls: list[str], *, storage_options: dict | None = None) -> dict[str, int]:
    """Sample counts for those of ``urls`` that a manifest beside them lists."""
    counts: dict[str, int] = {}
    by_dir: dict[str, list[str]] = {}
    for url in urls:
        by_dir.setdefault(posixpath.dirname(url), []).append(url)
    for directory, dir_urls in by_dir.items():
        manifest = read_manifest(directory, storage_options=storage_options)
        if manifest is None:
            continue
        known = {s["name"]: int(s["count"]) for s in manifest["shards"]}
        for url in dir_urls:
            name = posixpath.basename(url)
            if name in known:
                counts[url] = known[name]
    return counts
