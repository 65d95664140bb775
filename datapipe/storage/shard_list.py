"""``ShardList``: the shard URLs of one folder, held compactly (one string of names and an offset array), with the
counts and checksums its manifest gives. A million URLs cost ~30 MB this way instead of ~100 MB of strings."""
from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import numpy as np

from datapipe.words import counted

_BLOCK = 65536


class ShardList(Sequence[str]):
    """``base/<name>`` for each name, in order; compares equal to a list of the same URLs.

    Args:
        base: the folder URL (no trailing ``/``).
        names: the shard names, one string joined by ``"\\n"``.
        starts: where each name starts in ``names`` (int64, one more entry than names: ``len(names) + 1``).
        counts: samples per shard (the manifest's), or None.
        checksums: sha256 per shard (``""`` where none), or None where the manifest has none.
        known_fingerprint: :meth:`fingerprint` of ``counts``, where already known.
    """

    def __init__(self, base: str, names: str, starts: np.ndarray, *, counts: list[int] | None = None,
                 checksums: Sequence[str] | None = None, known_fingerprint: str | None = None):
        self.base = base
        self.names = names
        self.starts = starts
        self.counts = counts
        self.checksums = checksums
        self.known_fingerprint = known_fingerprint  # the fingerprint of ``counts``, where the manifest's copy has it

    @classmethod
    def of(cls, base: str, names: Sequence[str], **kwargs) -> "ShardList":
        lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
        starts = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(lengths + 1, out=starts[1:])
        return cls(base, "\n".join(names), starts, **kwargs)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def name(self, i: int) -> str:
        return self.names[self.starts[i]:self.starts[i + 1] - 1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = _checked_index(i, len(self))
        return self._prefix() + self.name(i)

    def _blocks(self, size: int = _BLOCK) -> Iterator[list[str]]:
        """The names, a list per block of ``size`` (a ``split`` where no name holds a newline)."""
        n = len(self)
        for lo in range(0, n, size):
            hi = min(n, lo + size)
            block = self.names[self.starts[lo]:self.starts[hi] - 1].split("\n")
            if len(block) != hi - lo:  # a name with a newline in it
                block = [self.name(i) for i in range(lo, hi)]
            yield block

    def iter_names(self) -> Iterator[str]:
        for block in self._blocks():
            yield from block

    def _prefix(self) -> str:
        return self.base if self.base.endswith("/") else self.base + "/"

    def __iter__(self) -> Iterator[str]:
        prefix = self._prefix()
        for name in self.iter_names():
            yield prefix + name

    def __eq__(self, other) -> bool:
        if isinstance(other, ShardList):
            return self.base == other.base and self.names == other.names
        return isinstance(other, Sequence) and not isinstance(other, str) and len(other) == len(self) \
            and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"ShardList({self.base!r}, {counted(len(self), 'shard')})"

    def fingerprint(self, counts: Sequence[int]) -> str | None:
        """``datapipe.read.shards.fingerprint`` of these URLs, computed a block at a time; None when a name holds
        a ``/`` (its basename is not the name: compute it the long way)."""
        if counts is self.counts and self.known_fingerprint is not None:
            return self.known_fingerprint
        if "/" in self.names:
            return None
        digest = hashlib.sha1()
        checksums = self.checksums
        lo = 0
        for block in self._blocks(_BLOCK // 8):  # a few MB of strings at a time
            hi = lo + len(block)
            if checksums is None:
                text = "|".join(map("{}:{}".format, block, counts[lo:hi]))
            else:
                text = "|".join(f"{a}:{c}" + (f":{h}" if h else "")
                                for a, c, h in zip(block, counts[lo:hi], checksums[lo:hi]))
            digest.update(((("|" if lo else "") + text)).encode())
            lo = hi
        return digest.hexdigest()[:16]


class NumberedUrls(Sequence[str]):
    """``f"{head}{i:0{width}d}{tail}"`` for ``lo <= i <= hi``: a brace range's URLs, made as they are read (a
    million of them cost nothing until then); compares equal to the list of the same URLs."""

    def __init__(self, head: str, lo: int, hi: int, width: int, tail: str):
        self.head, self.lo, self.hi, self.width, self.tail = head, lo, hi, width, tail

    def __len__(self) -> int:
        return self.hi - self.lo + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = _checked_index(i, len(self))
        return f"{self.head}{self.lo + i:0{self.width}d}{self.tail}"

    def __iter__(self) -> Iterator[str]:
        head, width, tail = self.head, self.width, self.tail
        if "\n" in head + tail:
            yield from (f"{head}{i:0{width}d}{tail}" for i in range(self.lo, self.hi + 1))
            return
        for lo in range(self.lo, self.hi + 1, _BLOCK):  # a block's URLs made as one string, then split
            yield from numbered_names(head, lo, min(self.hi, lo + _BLOCK - 1), width, tail).split("\n")

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and len(other) == len(self) \
            and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"NumberedUrls({self[0]!r}, ... {len(self)} URLs)"

    def in_folder(self) -> tuple[str, str] | None:
        """``(folder, names joined by "\\n")`` when every URL lies in one folder (the digits are in the name)."""
        folder, _, name_head = self.head.rpartition("/")
        if not _ or "/" in self.tail:
            return None
        return folder, numbered_names(name_head, self.lo, self.hi, self.width, self.tail)


def numbered_names(head: str, lo: int, hi: int, width: int, tail: str) -> str:
    """``"\n".join(f"{head}{i:0{width}d}{tail}" for i in range(lo, hi + 1))``, made as a byte array (a row per
    number, its digits written a column at a time) instead of a string per number."""
    head_b, tail_b = head.encode(), tail.encode()
    parts = []
    i = lo
    while i <= hi:  # one run per digit count: its rows have one length
        digits = max(width, len(str(i)))
        j = min(hi, 10 ** digits - 1)
        rows = np.empty((j - i + 1, len(head_b) + digits + len(tail_b) + 1), dtype=np.uint8)
        rows[:, :len(head_b)] = np.frombuffer(head_b, dtype=np.uint8)
        rows[:, len(head_b) + digits:-1] = np.frombuffer(tail_b, dtype=np.uint8)
        rows[:, -1] = ord("\n")
        numbers = np.arange(i, j + 1, dtype=np.int64)
        for k in range(digits):
            rows[:, len(head_b) + digits - 1 - k] = numbers % 10 + ord("0")
            numbers //= 10
        parts.append(rows.reshape(-1))
        i = j + 1
    joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return str(memoryview(joined[:-1]), "utf-8")


def _checked_index(i: int, n: int) -> int:
    """``i`` as a position in a sequence of ``n`` (negative counts from the end); IndexError outside it."""
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError("shard index out of range")
    return i
