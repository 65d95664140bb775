"""The segment reader: a worker's plan (:mod:`datapipe.order.plan`) turned into samples. Each segment's shard
is opened (cache or storage, with retries), its samples walked, and damage and missing samples turned into
LOST positions under the ``on_error`` policy, counted in the stream's ledger."""
from __future__ import annotations

from typing import Any, Iterator

from datapipe.errors import DataError
from datapipe.order.plan import WorkerPlan
from datapipe.read.shards import Shards
from datapipe.storage.urls import redact_url
from datapipe.tar import member_table
from datapipe.tar.blocks import MmapReader, reader_for
from datapipe.tar.headers import TarFormatError
from datapipe.tar.member_table import PASSED
from datapipe.tar.reader import SampleEvent, walk_samples


class _Lost:
    """A sample position that could not be read (kept so the shuffle buffer stays replayable)."""

    __slots__ = ()


LOST = _Lost()


def _view_of(reader: MmapReader):
    """``read(offset, size)``: a zero-copy view of the mapped shard (the reader lets go of pages behind it)."""
    def view(offset: int, size: int):
        reader.offset = offset
        return reader.read_view(size)
    return view


class _Cursor:
    """Where the read of a segment stands: the next sample ordinal expected, the key of the last one seen."""

    __slots__ = ("expected", "last_key")

    def __init__(self, expected: int):
        self.expected = expected
        self.last_key: str | None = None


class SegmentReader:
    """Reads the segments of a worker's plan from ``shards``: samples, or LOST for those that could not be read.

    Within a shard it keeps one whole sample in hand: a sample is handed out once the next one is read (or a
    loss, an error or the shard's end comes first). The newest value is then still alive when the consumer
    lets an older batch go, so the allocator reuses that batch's memory for the next instead of giving it
    back to the system and faulting fresh pages in for every value (order, losses and errors are unchanged).

    Args:
        shards: the stream's shards (URLs, counts, how to open them; its ledger counts what is read and lost).
        zero_copy: values of local uncompressed shards as memoryviews into the mapped file.
        read_threads: threads that read a local shard's values ahead through its member table (0: a ``pread``
            per value; :mod:`datapipe.read.spans`).
    """

    def __init__(self, shards: Shards, *, zero_copy: bool = False, read_threads: int = 0):
        self.shards = shards
        self.ledger = shards.ledger
        self.zero_copy = zero_copy
        self.read_threads = read_threads

    def items(self, plan: WorkerPlan, first: int) -> Iterator[Any]:
        """The plan's samples (or LOST) from position ``first`` on."""
        pos = 0
        for seg in plan.segments:
            n = len(seg)
            if pos + n > first:
                yield from self._read_segment(seg.shard, seg.start + max(0, first - pos), seg.stop)
            pos += n

    def positions(self, plan: WorkerPlan, first: int, keep=None) -> Iterator[tuple[int, Any]]:
        """``(position, sample or LOST)`` for the plan's positions from ``first`` on. Where ``keep(position)`` is
        false, a shard read through its member table reads nothing and yields ``PASSED`` in the sample's place."""
        pos = 0
        for seg in plan.segments:
            n = len(seg)
            if pos + n <= first:
                pos += n
                continue
            skip = max(0, first - pos)
            keep_ordinal = None if keep is None else (lambda o, base=pos - seg.start: keep(base + o))
            for offset, item in enumerate(self._read_segment(seg.shard, seg.start + skip, seg.stop, keep_ordinal)):
                yield pos + skip + offset, item
            pos += n

    def _read_segment(self, shard: int, start: int, stop: int, keep=None) -> Iterator[Any]:
        """Exactly ``stop - start`` items: samples, or LOST for those that could not be read.

        Open the shard, walk its samples (``_walk_segment``), close it, then lose what it lacked. Every
        error goes to the ``on_error`` policy: one it lets through loses the rest of the segment.
        """
        url = self.shards.urls[shard]
        try:
            f, seekable, tee = self.shards.open(url)
        except DataError as e:
            yield from self.lose(e, stop - start, counted=self._first_fault(shard, start, stop))
            return
        self.ledger.counts["shards_opened"] += 1
        reader = reader_for(f, seekable=seekable)
        cursor = _Cursor(start)
        damaged = url in self.shards.damage
        try:
            yield from self._walk_segment(reader, shard, start, stop, cursor, look_past=not damaged, keep=keep)
            if tee is not None and not damaged:
                tee.finish()
        except TarFormatError as e:
            after = f" (after the whole sample {cursor.last_key!r})" if e.key is None and cursor.last_key else ""
            err = self._error(f"unreadable tar data at byte {e.offset}: {e}{after}", url, e.key)
            err.__cause__ = e
            yield from self.lose(err, stop - cursor.expected, counted=self._first_fault(shard, start, stop))
            cursor.expected = stop
        except DataError as e:
            if e is self.ledger.errors.stopped:
                raise  # the policy's handler stopped the walk: not an error to handle again
            yield from self.lose(e, stop - cursor.expected, counted=self._first_fault(shard, start, stop))
            cursor.expected = stop
        finally:
            self.shards.close(f, reader)
            self.ledger.publish()
        if cursor.expected < stop:
            yield from self.lose(self._error(f"shard ends at byte {reader.offset} after {cursor.expected} samples, "
                                              f"{stop} expected (truncated, or the manifest is wrong)",
                                              url, cursor.last_key), stop - cursor.expected,
                                  counted=self._first_fault(shard, start, stop))

    def _walk_segment(self, reader, shard: int, start: int, stop: int, cursor: "_Cursor", *,
                      look_past: bool, keep=None) -> Iterator[Any]:
        """The shard's samples ``start <= i < stop`` as the tar reader finds them, LOST for the bad and
        the missing ones; ``cursor`` is left at the next ordinal expected (also when an error stops the
        walk). ``look_past``: at the shard's end, read one sample further so that a shard longer than
        its count is reported."""
        url = self.shards.urls[shard]
        counts, errors = self.shards.counts, self.ledger.errors
        past = stop + 1 if look_past and stop == counts[shard] else stop
        expected, last_key = start, None  # the cursor, kept in locals on this hot path
        held = None  # a whole sample read, handed out once the next one is read (or anything else happens)
        try:
            g, events = self._table_walk(reader, url, start, past, keep) or walk_samples(
                reader, url, start=start, stop=past, resync=not errors.raises, zero_copy=self.zero_copy)
            for event in events:
                if type(event) is dict:  # a whole sample (at g.ordinal)
                    ordinal = g.ordinal
                    if ordinal == expected and ordinal < stop:  # the common case
                        last_key = g.key
                        expected += 1
                        if held is not None:
                            yield held
                        held = event
                        continue
                    event = SampleEvent(ordinal, g.key, event)
                ordinal = event.ordinal
                if held is not None:  # what follows (a loss, an error, the end) comes after it
                    sample, held = held, None
                    yield sample
                if ordinal is None:  # damage not tied to a position: the count at the end tells what it cost
                    errors(self._error(f"damaged tar data skipped: {event.error}", url, last_key), lost=0)
                    continue
                if ordinal >= stop:
                    errors(self._error(f"shard holds more than the {counts[shard]} samples its "
                                             "manifest lists", url, event.key), lost=0)
                    break
                if ordinal > expected:
                    yield from self.lose(self._error("samples missing before this one", url, event.key),
                                          ordinal - expected)
                    expected = ordinal
                last_key = event.key
                expected += 1
                if event.sample is None:
                    yield from self.lose(self._error(f"bad sample: {event.error}", url, event.key), 1)
                    continue
                yield event.sample
        except Exception:
            if held is not None:  # the sample before the failure is handed out first, as it was read first
                sample, held = held, None
                yield sample
            raise
        finally:
            cursor.expected, cursor.last_key = expected, last_key
        if held is not None:
            yield held

    def _table_walk(self, reader, url: str, start: int, stop: int, keep=None):
        """``(position, samples)`` read through the shard's member table (a local plain shard that has a sound
        one: each value one ``pread``, or a view into the mapped file with ``zero_copy``; no header walked), or
        None: the shard is walked."""
        table = member_table.of_reader(reader)
        if table is None:
            return None
        reader.offset = table.end  # where the table read ends, for messages about a shard that ends early
        where = member_table.Position()
        return where, member_table.samples(table, reader._fd, url, where, start=start, stop=stop, keep=keep,
                                           read_large=lambda offset, size: reader.mm[offset:offset + size],
                                           read=_view_of(reader) if self.zero_copy else None,
                                           threads=self.read_threads)

    def _error(self, message: str, url: str, key: str | None) -> DataError:
        return DataError(message, url=redact_url(url), key=key)

    def _first_fault(self, shard: int, start: int, stop: int) -> bool:
        """Whether this read counts the failure that loses the rest of its part of ``shard`` as an error: yes,
        unless the part is one of a shard split between workers and another worker counted it first."""
        return (start == 0 and stop >= self.shards.counts[shard]) or self.ledger.first_fault(shard)

    def lose(self, err: DataError, n: int, *, counted: bool = True) -> Iterator[Any]:
        """``n`` LOST positions because of ``err`` (after the policy let it through, counting them; the error
        too unless another worker counted it: ``counted``)."""
        self.ledger.errors(err, lost=n, counted=counted)
        self.ledger.publish()
        for _ in range(n):
            yield LOST
