"""Reading one segment of a ``ShardStream`` plan: open the shard (cache or storage, with retries),
walk its samples, and turn damage and missing samples into LOST positions under the ``on_error`` policy."""
from __future__ import annotations

from typing import Any, Iterator

from datapipe.errors import DataError
from datapipe.order.plan import WorkerPlan
from datapipe.storage.files import RetryingFile, decompress, open_shard
from datapipe.storage.urls import is_local, redact_url
from datapipe.tar.blocks import reader_for
from datapipe.tar.headers import TarFormatError
from datapipe.tar.reader import iter_samples


class _Lost:
    """A sample position that could not be read (kept so the shuffle buffer stays replayable)."""

    __slots__ = ()


LOST = _Lost()


class _Cursor:
    """Where the read of a segment stands: the next sample ordinal expected, the key of the last one seen."""

    __slots__ = ("expected", "last_key")

    def __init__(self, expected: int):
        self.expected = expected
        self.last_key: str | None = None


class SegmentReading:
    """``ShardStream``'s reads of its plan's segments (a mixin: the state lives on the stream)."""

    def _read_items(self, plan: WorkerPlan, first: int) -> Iterator[Any]:
        """The plan's samples (or LOST) from position ``first`` on."""
        pos = 0
        for seg in plan.segments:
            n = len(seg)
            if pos + n > first:
                yield from self._read_segment(seg.shard, seg.start + max(0, first - pos), seg.stop)
            pos += n

    def _read_positions(self, plan: WorkerPlan, first: int) -> Iterator[tuple[int, Any]]:
        """``(position, sample or LOST)`` for the plan's positions from ``first`` on."""
        pos = 0
        for seg in plan.segments:
            n = len(seg)
            if pos + n <= first:
                pos += n
                continue
            skip = max(0, first - pos)
            for offset, item in enumerate(self._read_segment(seg.shard, seg.start + skip, seg.stop)):
                yield pos + skip + offset, item
            pos += n

    def _read_segment(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        """Exactly ``stop - start`` items: samples, or LOST for those that could not be read.

        Open the shard, walk its samples (``_walk_segment``), close it, then lose what it lacked. Every
        error goes to the ``on_error`` policy: one it lets through loses the rest of the segment.
        """
        url = self.urls[shard]
        try:
            f, seekable, tee = self._open(url)
        except DataError as e:
            yield from self._lose(e, stop - start)
            return
        self._stats["shards_opened"] += 1
        reader = reader_for(f, seekable=seekable)
        cursor = _Cursor(start)
        damaged = url in self._damage
        try:
            yield from self._walk_segment(reader, shard, start, stop, cursor, look_past=not damaged)
            if tee is not None and not damaged:
                tee.finish()
        except TarFormatError as e:
            after = f" (after the whole sample {cursor.last_key!r})" if e.key is None and cursor.last_key else ""
            err = self._error(f"unreadable tar data at byte {e.offset}: {e}{after}", url, e.key)
            err.__cause__ = e
            yield from self._lose(err, stop - cursor.expected)
            cursor.expected = stop
        except DataError as e:
            if e is self._errors.stopped:
                raise  # the policy's handler stopped the walk: not an error to handle again
            yield from self._lose(e, stop - cursor.expected)
            cursor.expected = stop
        finally:
            self._close(f, reader)
        if cursor.expected < stop:
            yield from self._lose(self._error(f"shard ends at byte {reader.offset} after {cursor.expected} samples, "
                                              f"{stop} expected (truncated, or the manifest is wrong)",
                                              url, cursor.last_key), stop - cursor.expected)

    def _walk_segment(self, reader, shard: int, start: int, stop: int, cursor: "_Cursor", *,
                      look_past: bool) -> Iterator[Any]:
        """The shard's samples ``start <= i < stop`` as the tar reader finds them, LOST for the bad and
        the missing ones; ``cursor`` is left at the next ordinal expected (also when an error stops the
        walk). ``look_past``: at the shard's end, read one sample further so that a shard longer than
        its count is reported."""
        url = self.urls[shard]
        past = stop + 1 if look_past and stop == self.counts[shard] else stop
        expected, last_key = start, None  # the cursor, kept in locals on this hot path
        try:
            for event in iter_samples(reader, url, start=start, stop=past, resync=not self._errors.raises,
                                      zero_copy=self.zero_copy):
                ordinal = event.ordinal
                if ordinal is None:  # damage not tied to a position: the count at the end tells what it cost
                    self._errors(self._error(f"damaged tar data skipped: {event.error}", url, last_key), lost=0)
                    continue
                if ordinal >= stop:
                    self._errors(self._error(f"shard holds more than the {self.counts[shard]} samples its "
                                             "manifest lists", url, event.key), lost=0)
                    break
                if ordinal > expected:
                    yield from self._lose(self._error("samples missing before this one", url, event.key),
                                          ordinal - expected)
                    expected = ordinal
                last_key = event.key
                expected += 1
                if event.sample is None:
                    yield from self._lose(self._error(f"bad sample: {event.error}", url, event.key), 1)
                    continue
                yield event.sample
        finally:
            cursor.expected, cursor.last_key = expected, last_key

    def _error(self, message: str, url: str, key: str | None) -> DataError:
        return DataError(message, url=redact_url(url), key=key)

    def _close(self, f, reader) -> None:
        """Close a shard, counting the bytes it gave and the retries its reads took."""
        self._stats["bytes_read"] += reader.offset
        self._stats["retries"] += getattr(getattr(f, "myfileobj", None) or f, "retried", 0)
        if self._cache is not None:
            self._stats["cache_failures"] = self._cache.failures  # the cache's own count (it may fail at open)
        if hasattr(reader, "close"):
            reader.close()
        f.close()

    def _open(self, url: str):
        """``(file, seekable, tee)``: the shard from the cache or storage; ``tee`` is set while caching it."""
        if self._cache is None or is_local(url) or url.startswith("pipe:"):
            f, seekable = open_shard(url, storage_options=self._options(url), retries=self.retries,
                                     allow_pipe=self.allow_pipe, backoff=self.backoff)
            return f, seekable, None
        options = self._options(url)
        raw, hit = self._cache.open(url, lambda: RetryingFile(url, storage_options=options, retries=self.retries,
                                                              backoff=self.backoff),
                                    sha256=self._checksum(url))
        self._stats["cache_hits"] += hit
        f, seekable = decompress(url, raw, seekable=raw.seekable())
        return f, seekable, (raw if hasattr(raw, "finish") else None)

    def _lose(self, err: DataError, n: int) -> Iterator[Any]:
        """``n`` LOST positions because of ``err`` (after the policy let it through, counting them)."""
        self._errors(err, lost=n)
        for _ in range(n):
            yield LOST
