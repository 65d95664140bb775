"""Sample counts of shards that no manifest lists: counted once, then cached.

The counts live in a small JSON sidecar beside the shards (``.datapipe-counts.json``) where that
directory is local and writable (``datapipe index`` writes it on any storage), else in a local
cache directory (``~/.cache/datapipe/counts``), one file per shard directory. Every entry is
keyed by the shard's name and stamped with its size and modification time (or ETag): a shard
that changed is counted again. An entry also remembers damage (``"damage"``: the message naming
the byte), so a damaged shard is reported the same way whether it was counted now or earlier.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import fsspec

from datapipe.storage.files import filesystem, write_json
from datapipe.storage.stamps import stamp  # noqa: F401  (re-exported: the count cache's stamp)
from datapipe.storage.urls import is_local, redact_text, redact_url

log = logging.getLogger("datapipe.tar.counts")

SIDECAR = ".datapipe-counts.json"
FORMAT = "datapipe-counts"
DEFAULT_CACHE_DIR = "~/.cache/datapipe/counts"
THREADS = 16


def _cache_file(directory: str, cache_dir: str) -> str:
    digest = hashlib.sha256(directory.encode()).hexdigest()[:24]
    return os.path.join(os.path.expanduser(cache_dir), f"{digest}.json")


def _read_json(url: str, storage_options: dict | None) -> dict:
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        with fs.open(path, "r") as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("shards"), dict):
            return data["shards"]
    except Exception as e:  # a missing or unreadable cache only means counting again
        log.debug("no usable count cache at %s: %s", redact_url(url), redact_text(e))
    return {}


def _map(fn: Callable, items: list, *, desc: str | None = None) -> list:
    """``fn`` over ``items`` in a thread pool, in order, with a progress bar on stderr (on a terminal)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    from tqdm import tqdm

    with ThreadPoolExecutor(min(THREADS, len(items))) as pool:
        return list(tqdm(pool.map(fn, items), total=len(items), desc=desc, disable=None if desc else True,
                         unit="shard", leave=False))


def load_counts(urls: list[str], *, storage_options: dict | None = None,
                cache_dir: str = DEFAULT_CACHE_DIR) -> dict[str, dict]:
    """Cached entries ``{"count", "damage"}`` for those of ``urls`` whose shard has not changed since."""
    by_dir: dict[str, list[str]] = {}
    for url in urls:
        by_dir.setdefault(posixpath.dirname(url), []).append(url)
    candidates: dict[str, dict] = {}
    for directory, dir_urls in by_dir.items():
        known = _read_json(_cache_file(directory, cache_dir), None)
        known.update(_read_json(posixpath.join(directory, SIDECAR), storage_options))
        for url in dir_urls:
            entry = known.get(posixpath.basename(url))
            if isinstance(entry, dict) and isinstance(entry.get("count"), int):
                candidates[url] = entry
    if not candidates:
        return {}
    wanted = list(candidates)

    def current(url):
        try:
            return stamp(url, storage_options)
        except Exception:
            return None

    stamps = _map(current, wanted)
    return {url: candidates[url] for url, s in zip(wanted, stamps)
            if s is not None and s == candidates[url].get("stamp")}


def store_counts(entries: dict[str, dict], *, storage_options: dict | None = None,
                 cache_dir: str = DEFAULT_CACHE_DIR, beside: bool | None = None) -> list[str]:
    """Remember ``{url: {"count", "damage", "stamp"}}``; returns the files written.

    ``beside``: True writes the sidecar beside the shards (any storage; errors raise), None does so
    where the shards are local and the directory writable, else in ``cache_dir``; False: ``cache_dir`` only.
    """
    by_dir: dict[str, dict[str, dict]] = {}
    for url, entry in entries.items():
        by_dir.setdefault(posixpath.dirname(url), {})[posixpath.basename(url)] = entry
    written = []
    for directory, shards in by_dir.items():
        targets = []
        if beside or (beside is None and is_local(directory or ".")):
            targets.append((posixpath.join(directory, SIDECAR), storage_options, beside is True))
        targets.append((_cache_file(directory, cache_dir), None, False))
        for url, options, must in targets:
            try:
                merged = {**_read_json(url, options), **shards}
                parent = posixpath.dirname(filesystem(url, options)[1])
                if options is None and parent:
                    os.makedirs(parent, exist_ok=True)
                write_json(url, {"format": FORMAT, "version": 1, "shards": merged}, options, sort_keys=True)
                written.append(url)
                break
            except Exception as e:  # e.g. a read-only file system, or storage that cannot write (HTTP)
                if must:
                    raise OSError(f"cannot write {redact_url(url)}: {redact_text(e)}") from e
                log.debug("cannot write the count cache %s: %s", redact_url(url), redact_text(e))
    return written


def count_shard(url: str, *, storage_options: dict | None = None, retries: int = 5) -> dict[str, Any]:
    """``{"count", "damage", "stamp"}`` of one shard: its samples (from its member table where it has a sound one,
    else walking headers only, past damaged headers as a skip read goes) and the damage that cut it short (a
    message naming the byte), or None.
    Unreadable: ``DataError``."""
    from datapipe.errors import DataError
    from datapipe.storage.files import open_shard
    from datapipe.tar.blocks import reader_for
    from datapipe.tar.reader import count_until_damage

    from datapipe.tar import member_table

    version = stamp(url, storage_options)
    f, seekable = open_shard(url, storage_options=storage_options, retries=retries)
    try:
        reader = reader_for(f, seekable=seekable)
        table = member_table.of_reader(reader)
        # a sound member table holds what a read of the shard yields (reads go through it too): no walk
        n, err = (len(table), None) if table is not None else count_until_damage(reader)
    except OSError as e:
        raise DataError(f"cannot count samples: {e}", url=redact_url(url)) from e
    finally:
        f.close()
    damage = None
    if err is not None:
        damage = f"shard damaged at byte {err.offset}: {err} ({n} complete samples before it are read)"
    return {"count": n, "damage": damage, "stamp": version}


def count_and_store(urls: list[str], *, storage_options: dict | None = None, cache_dir: str = DEFAULT_CACHE_DIR,
                    progress: bool = True) -> dict[str, dict]:
    """Count ``urls`` (in parallel) and remember the counts beside them (else in ``cache_dir``).

    What ``datapipe index`` runs, so that streams over these shards never count them again.
    """
    entries = dict(zip(urls, _map(lambda u: count_shard(u, storage_options=storage_options), urls,
                                  desc="counting samples" if progress else None)))
    try:
        store_counts(entries, storage_options=storage_options, cache_dir=cache_dir, beside=True)
    except OSError as e:
        log.info("cannot write the counts beside the shards (%s): keeping them in %s", e, cache_dir)
        store_counts(entries, storage_options=storage_options, cache_dir=cache_dir, beside=False)
    return entries
