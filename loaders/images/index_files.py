"""DALI index files for ``ImageLoader``'s DALI reader: beside a shard when fresh, else made once in a folder.

Files made in the folder are named by the shard's path, size and modification time, so a changed shard gets a
new one. Each use refreshes a file's modification time, and a making prunes the folder's files left unused for
``UNUSED_DAYS``, so the shared temporary folder does not fill with the index files of shards long gone.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time

from datapipe.words import counted

log = logging.getLogger("loaders.images")

INDEX_NOTE_S = 1.0  # making index files for longer than this is logged
UNUSED_DAYS = 7.0  # index files made here and unused this long are removed when another is made
_DAY_S = 86400.0


def default_directory() -> str:
    """Where index files are made when ``ReadOptions(index_dir=)`` is not given."""
    return os.path.join(tempfile.gettempdir(), "datapipe-dali-index")


def index_paths(paths: list[str], index_dir: str | None) -> list[str]:
    """DALI index files of local shards: beside the shard when fresh, else made in ``index_dir``."""
    from datapipe.tar.dali_index import default_index_path, write_dali_index

    out = []
    made, started, now = 0, time.perf_counter(), time.time()
    directory = index_dir or default_directory()
    for path in paths:
        beside = default_index_path(path)
        if os.path.exists(beside) and os.path.getmtime(beside) >= os.path.getmtime(path):
            out.append(beside)
            continue
        st = os.stat(path)
        tag = hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        target = os.path.join(directory, f"{os.path.basename(path)}.{tag}.idx")
        if not _reuse(target, now):
            os.makedirs(directory, exist_ok=True)
            write_dali_index(path, target)
            made += 1
        out.append(target)
    took = time.perf_counter() - started
    if made:
        prune(directory, keep=set(out), now=now)
    if made and took > INDEX_NOTE_S:
        log.info("made DALI index files for %s in %s (%.1f s; reused while the shards are unchanged; `datapipe "
                 "index` or `datapipe shard --index` writes them beside the shards)", counted(made, "shard"),
                 directory, took)
    return out


def _reuse(target: str, now: float) -> bool:
    """Whether ``target`` exists; its modification time is refreshed once a day of use (what pruning goes by)."""
    try:
        if now - os.stat(target).st_mtime > _DAY_S:
            os.utime(target)
        return True
    except FileNotFoundError:  # never made, or pruned by another process just now
        return False


def prune(directory: str, *, keep: set[str], now: float) -> int:
    """Remove the ``.idx`` files in ``directory`` unused for ``UNUSED_DAYS`` (not those in ``keep``); how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:  # gone, or not ours to list
        return 0
    for entry in entries:
        if not entry.name.endswith(".idx") or entry.path in keep:
            continue
        try:
            if now - entry.stat().st_mtime > UNUSED_DAYS * _DAY_S:
                os.remove(entry.path)
                removed += 1
        except OSError:  # another process removed it first, or it is not ours to remove
            pass
    if removed:
        log.info("removed %s unused for %g days from %s", counted(removed, "DALI index file"), UNUSED_DAYS,
                 directory)
    return removed
