"""Which reader feeds ImageLoader's DALI pipeline: DALI's own ``fn.readers.webdataset`` or the ShardStream reader.

DALI's reader is faster and holds the GIL less, but it reads local files only, raises on any error (no
``on_error="skip"``), keeps no cache and cannot decode GIF; the stream reader does all of that
(:mod:`loaders.images.stream_reader`).
"""
from __future__ import annotations

import logging

log = logging.getLogger("loaders.images")


def gif_in_shards(loader):
    """``(shard path, member)`` of a GIF among the local shards' image entries (DALI's reader case), or None."""
    from datapipe.storage.urls import local_path
    from loaders.images.dali_reader import gif_member

    if "gif" not in loader.read.image_exts:
        return None
    try:
        counts = loader.stream.counts
        return gif_member([local_path(u) for u, c in zip(loader.stream.urls, counts) if c > 0], loader.read.index_dir)
    except Exception:  # an unreadable shard: DALI's reader names it when it reads
        return None


def choose_reader(loader, reader: str) -> str:
    """``"dali"`` or ``"stream"`` for ``ReadOptions.reader`` (``"auto"``, ``"dali"`` or ``"stream"``).

    ``"auto"`` takes DALI's reader where it can read the shards as the stream would, else the stream
    reader; ``"dali"`` where it cannot raises ``ValueError`` saying why and what to pass instead.
    """
    from datapipe.storage.urls import is_local

    stream = loader.stream
    dali_ok = (all(is_local(u) for u in stream.urls) and loader._errors.raises
               and getattr(stream, "cache_dir", None) is None)
    if reader == "dali" and not dali_ok:
        raise ValueError("reader='dali' needs local shards, on_error='raise' and no cache_dir on the stream; "
                         "use reader='stream'")
    if reader == "auto":
        plain = not (loader.read.label_key.startswith("__") or loader.read.read_workers)
        reader = "dali" if dali_ok and plain else "stream"
        if reader == "dali" and gif_in_shards(loader) is not None:
            log.info("these shards hold GIF images, which DALI's reader cannot decode: ImageLoader reads them "
                     "with the stream reader (which re-encodes GIFs as PNG)")
            return "stream"
        return reader
    gif = gif_in_shards(loader) if reader == "dali" else None
    if gif is not None:
        path, member = gif
        raise ValueError(f"reader='dali': DALI cannot decode GIF images and {path} holds one ({member!r}); "
                         "use reader='stream' or 'auto' (they re-encode GIFs as PNG)")
    return reader
