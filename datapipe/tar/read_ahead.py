"""A shard's values read ahead by pool threads while its samples are handed out (through its member table).

``ReadAhead`` takes the next chunk of samples' values (a few MB a thread) from :func:`datapipe.read.spans.start_spans`
and starts the chunk after it before the caller hands out this one's: the kernel's copies run on other cores.
"""
from __future__ import annotations

from datapipe.read import spans


class Chunk:
    """The kept samples ``wanted`` of positions ``start <= i < until`` and their values being read (``reading``,
    None where they cannot be read together: a value over 32 MB, a single sample)."""

    __slots__ = ("start", "until", "wanted", "reading")

    def __init__(self, start: int, until: int, wanted: list[int], reading):
        self.start, self.until, self.wanted, self.reading = start, until, wanted, reading


class ReadAhead:
    """The values of the samples ahead, read by pool threads (``start_spans``) about ``CHUNK_BYTES`` a thread at
    a time, the next chunk read while the caller hands out this one's. ``values(i)`` is None where they could not
    be (a value over 32 MB, a file that shrank): that sample is then read on its own, which says what went wrong.
    A read no longer wanted (the caller stopped early) is let run to its end on its own duplicate of the file
    descriptor, so the caller may close its file at once. A shard of small samples (under ``MIN_SAMPLE_BYTES`` a
    sample in a chunk) is read a ``pread`` a value from there on: making their ``bytes`` for the threads costs the
    consuming thread what the reads would."""

    CHUNK_BYTES = 8 << 20  # read ahead per thread: the values of ~80 samples of 100 KB, held until handed out
    MAX_SAMPLES = 256
    MIN_SAMPLE_BYTES = 16 << 10

    def __init__(self, members: list, fd: int, stop: int, keep, threads: int):
        self.members, self.fd, self.stop, self.keep, self.threads = members, fd, stop, keep, threads
        self.held: dict[int, list] = {}
        self.until = -1  # samples before this were read ahead (or tried)
        self.next: Chunk | None = None

    def values(self, i: int) -> list | None:
        if i >= self.until:
            if self.threads == 0:
                return None  # small values: a pread each
            self._take(i)
        return self.held.pop(i, None)

    def close(self) -> None:
        """Drop what was read ahead (a read still running ends by itself; nothing waits for it)."""
        self.next = None
        self.held.clear()

    def _take(self, i: int) -> None:
        self.held.clear()
        chunk, self.next = self.next, None
        if chunk is None or not chunk.start <= i < chunk.until:
            chunk = self._start(i)  # (a chunk read ahead that is not wanted after all ends by itself)
        self.until = chunk.until
        if chunk.until < self.stop and self.threads:
            self.next = self._start(chunk.until)  # read on while this chunk's samples are handed out
        values = chunk.reading.result() if chunk.reading is not None else None
        if values is None:
            return
        at = 0
        for j in chunk.wanted:
            n = len(self.members[j])
            self.held[j] = values[at:at + n]
            at += n

    def _start(self, i: int) -> Chunk:
        members, keep, budget = self.members, self.keep, self.CHUNK_BYTES * self.threads
        wanted, at, filled, j = [], [], 0, i
        while j < self.stop and filled < budget and len(wanted) < self.MAX_SAMPLES:
            if keep is None or keep(j):
                wanted.append(j)
                for _, offset, size in members[j]:
                    at.append((offset, size))
                    filled += size
            j += 1
        if wanted and filled < self.MIN_SAMPLE_BYTES * len(wanted):
            self.threads = 0
            return Chunk(i, j, wanted, None)
        reading = spans.start_spans(self.fd, at, threads=self.threads) if len(wanted) > 1 else None
        return Chunk(i, j, wanted, reading)
