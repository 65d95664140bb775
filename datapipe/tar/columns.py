"""A manifest's columns: shard names in one string with an offset array, counts and checksums, without a dict per
shard (what :func:`datapipe.tar.manifest.read_columns` returns and :mod:`datapipe.tar.manifest_cache` keeps)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class Checksums:
    """Checksums of one width in one string (``""`` kept as spaces): a list's indexing, a fraction of its memory."""

    def __init__(self, blob: str, width: int):
        self.blob, self.width = blob, width

    def __len__(self) -> int:
        return len(self.blob) // self.width

    def __getitem__(self, i):
        w = self.width
        if isinstance(i, slice):
            lo, hi, _ = i.indices(len(self))
            text = self.blob[lo * w:hi * w]
            return [text[j:j + w].strip() for j in range(0, len(text), w)]
        if i < 0:
            i += len(self)
        return self.blob[i * w:(i + 1) * w].strip()


def _checksums(values: list) -> Checksums | list[str] | None:
    if not any(values):
        return None
    width = max(len(v) for v in values if v)
    if all(isinstance(v, str) and (not v or len(v) == width) and " " not in v for v in values if v):
        return Checksums("".join(v or " " * width for v in values), width)
    return [v or "" for v in values]


@dataclass
class ManifestColumns:
    head: dict[str, Any]  # the manifest's other keys
    names: str  # the shard names joined by "\n"
    starts: np.ndarray  # where each name starts in ``names`` (int64; len(counts) + 1 entries)
    counts: list[int]
    checksums: Checksums | list[str] | None  # None: no shard has one
    fingerprint: str | None = None  # the shards' identity (``datapipe.read.shards.fingerprint``), where known

    @classmethod
    def of(cls, head: dict, names: list[tuple[str, np.ndarray]], counts: list[int],
           checksums: list) -> "ManifestColumns":
        """From blocks of names (each joined by ``"\n"``, with their lengths), so no list of every name is held."""
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        if names:
            np.cumsum(np.concatenate([lengths for _, lengths in names]) + 1, out=starts[1:])
        if starts[-1] < 2**31:
            starts = starts.astype(np.int32)  # half the memory for any names under 2 GB
        return cls(head, "\n".join(joined for joined, _ in names), starts, counts, _checksums(checksums))
