"""A compact local copy of a large manifest's columns (names, counts, checksums), so that a job that restarts
reads a million-shard manifest in milliseconds instead of parsing its JSON again.

The copy lives in ``~/.cache/datapipe/manifests`` (one ``.npz`` per manifest URL, no pickles), stamped with the
manifest's size and modification time (or ETag): a manifest that changed is parsed again. Only manifests
of at least ``MIN_BYTES`` are copied, and the ``KEEP`` most recently used copies are kept; a copy that cannot be
read or written only means parsing the JSON.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile

import numpy as np

from datapipe.tar.columns import Checksums, ManifestColumns

log = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/datapipe/manifests"
MIN_BYTES = 4 << 20  # ~45k shards: below it the JSON parses in well under 0.1 s
KEEP = 16  # copies kept; the least recently used beyond them are removed when one is written
_WRITE_BLOCK = 1 << 20  # characters of the names encoded at a time


def _path(url: str, cache_dir: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), hashlib.sha256(url.encode()).hexdigest()[:24] + ".npz")


def load(url: str, mark: dict, cache_dir: str = DEFAULT_DIR):
    """The cached ``ManifestColumns`` of ``url`` if its stamp is ``mark``, else None."""
    path = _path(url, cache_dir)
    try:
        with open(path, "rb") as f:
            meta, columns = read_file(f)
        if meta.get("url") != url or meta.get("stamp") != mark:
            return None
        _touch(path)
        return columns
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable or foreign: parse the manifest instead
        log.debug("manifest copy %s not used: %s", path, e)
        return None


def read_file(f) -> tuple[dict, ManifestColumns]:
    """``(meta, columns)`` of a columns file (a copy here, or a manifest's sidecar) open for reading."""
    with np.load(f, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        checksums = None
        if "checksums" in z:
            checksums = Checksums(bytes(z["checksums"]).decode("ascii"), int(meta["checksum_width"]))
        names = str(memoryview(z["names"]), "utf-8")  # decoded from the array's buffer: no bytes copy
        return meta, ManifestColumns(meta["head"], names, z["starts"], z["counts"].tolist(), checksums,
                                     meta.get("fingerprint"))


def write_file(f, meta: dict, columns) -> bool:
    """Write ``columns`` (with ``meta``, the fingerprint added) as a columns file to ``f``; False (nothing
    written) for checksums of uneven widths, which are not worth a copy."""
    from datapipe.storage.shard_list import ShardList

    shards = ShardList("", columns.names, columns.starts, checksums=columns.checksums)
    meta = {**meta, "head": columns.head, "fingerprint": columns.fingerprint or shards.fingerprint(columns.counts)}
    arrays = {"names": columns.names, "starts": columns.starts, "counts": _smallest(columns.counts)}
    if isinstance(columns.checksums, Checksums):
        arrays["checksums"] = columns.checksums.blob
        meta["checksum_width"] = columns.checksums.width
    elif columns.checksums is not None:
        return False
    with zipfile.ZipFile(f, "w", allowZip64=True) as z:  # ``np.savez``'s layout: one .npy per array
        for key, value in {"meta": json.dumps(meta), **arrays}.items():
            with z.open(key + ".npy", "w", force_zip64=True) as out:
                _write_array(out, value)
    return True


def _write_array(out, value) -> None:
    """``value`` as a .npy to ``out``: an array as numpy writes it; a string as its UTF-8 bytes (uint8), encoded
    a block at a time where it is ASCII (a million names: no second copy of them in memory)."""
    if isinstance(value, str) and not value.isascii():
        value = np.frombuffer(value.encode(), dtype=np.uint8)
    if isinstance(value, str):
        np.lib.format.write_array_header_2_0(out, {"descr": "|u1", "fortran_order": False, "shape": (len(value),)})
        for lo in range(0, len(value), _WRITE_BLOCK):
            out.write(value[lo:lo + _WRITE_BLOCK].encode("ascii"))
        return
    value = np.ascontiguousarray(value)
    np.lib.format.write_array_header_2_0(out, np.lib.format.header_data_from_array_1_0(value))
    out.write(memoryview(value.reshape(-1)).cast("B"))  # the array's own buffer: no copy of it


def store(url: str, mark: dict, columns, cache_dir: str = DEFAULT_DIR) -> None:
    """Keep ``columns`` of the manifest ``url`` (stamp ``mark``); failures are logged at debug level only."""
    path = _path(url, cache_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}.npz"
        with open(tmp, "wb") as f:
            written = write_file(f, {"url": url, "stamp": mark}, columns)
        if not written:
            os.remove(tmp)
            return
        os.replace(tmp, path)
        _evict(os.path.dirname(path))
    except Exception as e:  # a read-only home, a full disk: the next start parses the JSON again
        log.debug("cannot keep a copy of manifest %s in %s: %s", url, path, e)


def _smallest(values) -> np.ndarray:
    """``values`` as int32 where they fit (half the memory when read back), else int64."""
    try:
        return np.array(values, dtype=np.int32)
    except OverflowError:
        return np.array(values, dtype=np.int64)


def _touch(path: str) -> None:
    try:
        os.utime(path)  # used now: the last to be evicted
    except OSError:
        pass


def _evict(directory: str) -> None:
    """Remove all but the ``KEEP`` most recently used copies."""
    copies = []
    for name in os.listdir(directory):
        if name.endswith(".npz") and ".tmp-" not in name:
            try:
                copies.append((os.path.getmtime(os.path.join(directory, name)), name))
            except OSError:
                continue
    for _, name in sorted(copies, reverse=True)[KEEP:]:
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass
