"""What identifies one version of a stored file (for caches that must notice a change): size and mtime or ETag."""
from __future__ import annotations

from typing import Any

import fsspec


def stamp(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """What identifies this version of the file: size and mtime (local) or ETag / modification time."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    info = fs.info(path)
    version = info.get("mtime") or info.get("ETag") or info.get("etag") or info.get("LastModified") \
        or info.get("last_modified") or info.get("updated")
    return {"size": info.get("size"), "version": str(version) if version is not None else None}
