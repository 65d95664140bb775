"""``manifest.json``: the shard names, sample counts, sizes and checksums of a shard directory."""
from __future__ import annotations

import json
import posixpath
from typing import Any

import fsspec

MANIFEST_NAME = "manifest.json"
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
    """Write ``<directory>/manifest.json`` atomically (temporary name, then rename)."""
    from datapipe.storage.files import write_json

    url = manifest_url(directory)
    write_json(url, manifest, storage_options)
    return url


def read_manifest(directory: str, *, storage_options: dict | None = None, retries: int = 5,
                  backoff: float = 0.2) -> dict[str, Any] | None:
    """The manifest of a shard directory, or None when it has none. Transient failures are retried
    (``retries`` times, exponential backoff from ``backoff`` seconds). A manifest that cannot be read
    (no permission, wrong credentials, no connection, not JSON) is a ``DataError`` naming it."""
    from datapipe.errors import DataError
    from datapipe.storage.files import describe, retry_call, secrets_of
    from datapipe.storage.locations import redact_url

    url = manifest_url(directory)

    def load():
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        with fs.open(path, "r") as f:
            return json.load(f)

    try:
        manifest = retry_call(load, url, retries=retries, backoff=backoff, storage_options=storage_options,
                              what="manifest")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except DataError:
        raise
    except Exception as e:
        text, cause = describe(e, secrets_of(url, storage_options))
        raise DataError(f"cannot read the manifest: {text}", url=redact_url(url), what="manifest") from cause
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise DataError("not a datapipe manifest (no 'shards' list)", url=redact_url(url), what="manifest")
    return manifest


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
