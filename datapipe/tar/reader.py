"""Fast WebDataset tar parsing: tar members grouped into samples, no per-member ``tarfile`` objects.

``iter_samples`` walks the 512-byte tar headers itself (``headers.next_member`` over a
``blocks`` reader), groups members into samples with webdataset's key/extension rules, and can
start at a sample ordinal by seeking past the data of the samples before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from datapipe.tar.headers import (BLOCK, _KEY_EXT, TarFormatError, TarTruncated, _plain_member, is_meta, next_member,
                                  padded, split_key)


@dataclass(slots=True)
class SampleEvent:
    """One sample position of a shard: the sample, or None where it was damaged (``error`` says why).

    ``ordinal`` is None for damage that cannot be tied to a sample position (the reader lost
    track of where it was); the caller reconciles such losses against the expected count.
    """

    ordinal: int | None
    key: str | None
    sample: dict | None
    error: Exception | None = None


def _skip_member(reader, name: str, size: int, header_offset: int, key: str | None = None) -> None:
    """Skip a member's data and padding; ``TarTruncated`` if the stream ends first."""
    if not reader.skip(padded(size)):
        raise TarTruncated(f"tar stream ends inside member {name!r} ({size} bytes expected)", header_offset, key)


def _damage_owner(err: TarFormatError, next_name: str | None, key_now: str | None,
                  multi: bool | None) -> tuple[str | None, bool]:
    """Which sample a damaged header hit: ``(its key, or None when that cannot be told; whether the
    sample in progress is whole)``. ``next_name`` is the member after the damage, ``key_now`` the
    sample in progress, ``multi`` whether samples here have several members (None: not known yet)."""
    extension_header = err.name is not None and ("@PaxHeader" in err.name or err.name == "././@LongLink")
    guess = split_key(err.name)[0] if err.name and not extension_header else None
    next_match = _KEY_EXT.match(next_name) if next_name is not None else None
    next_key = next_match.group(1) if next_match is not None else None
    if extension_header:
        if key_now is not None and next_key == key_now:
            return key_now, False  # it belonged to the next member of the sample in progress
        return None, True  # it belonged to the next sample's first member
    if (guess is not None and guess != key_now and next_key is not None and guess != next_key and multi is not False
            and not err.intact):
        # a legible name that matches neither neighbour, in a shard of multi-member samples:
        # the name itself is what got damaged
        return None, False
    return guess, False


class _Grouping:
    """Where ``iter_samples`` stands in a shard: the sample being assembled, and what damage left behind."""

    __slots__ = ("url", "start", "stop", "ordinal", "key", "current", "damaged_key", "damage_next", "members",
                 "multi")

    def __init__(self, url: str, start: int, stop: int | None):
        self.url, self.start, self.stop = url, start, stop
        self.ordinal = -1         # ordinal of the sample being assembled
        self.key = None           # its key (None after damage)
        self.current = None       # its dict, or None when it lies before ``start`` or was damaged
        self.damaged_key = None   # a damaged sample's key: its further members are skipped
        self.damage_next = False  # damage without a legible name: the next sample may have lost members too
        self.members = 0          # members of the sample being assembled, plus the one being looked at
        self.multi = None         # whether samples of this shard have several members (None: not known yet)

    def in_range(self, i: int) -> bool:
        return i >= self.start and (self.stop is None or i < self.stop)

    def whole(self) -> SampleEvent:
        """The event of the sample being assembled, once it is known to be complete."""
        return SampleEvent(self.ordinal, self.key, self.current)

    def drop(self, damaged_key: str | None = None) -> None:
        """Give up the sample being assembled; members of ``damaged_key`` that follow are skipped."""
        self.current, self.key, self.damaged_key = None, None, damaged_key

    def damage(self, err: TarFormatError, next_name: str | None) -> list[SampleEvent]:
        """Events for a damaged header that the reader resynchronised past (``next_name``: the member after it)."""
        events = []
        guess, whole = _damage_owner(err, next_name, self.key, self.multi)
        if whole and self.current is not None:
            # a damaged pax / long-name header belongs to the next member: the current sample is whole
            events.append(self.whole())
            self.current, self.key = None, None
        if guess is not None and guess != self.key:
            # the damaged header starts a new sample: the one in progress is complete
            if self.current is not None:
                events.append(self.whole())
            self.ordinal += 1
            self.key = guess
        if self.key is not None:
            if self.in_range(self.ordinal):
                events.append(SampleEvent(self.ordinal, self.key, None, err))
            self.damaged_key = self.key
        else:
            events.append(SampleEvent(None, None, None, err))
        # without a legible name, the sample after the damage may have lost members too
        self.damage_next = guess is None
        self.current, self.key = None, None
        return events

    def count_members(self) -> None:
        """A new key begins: learn from the sample just ended whether samples here have several members."""
        if self.key is not None:
            if self.members > 2:
                self.multi = True
            elif self.multi is None:
                self.multi = False
        self.members = 1

    def begin(self, key: str) -> None:
        """Start the next sample (``key``), after ``count_members``; it is kept only from ordinal ``start`` on."""
        self.ordinal += 1
        self.key = key
        self.damaged_key = None
        self.current = {"__key__": key, "__url__": self.url} if self.ordinal >= self.start else None

    def lost_after_damage(self, key: str, header_offset: int) -> SampleEvent | None:
        """The sample just begun follows illegible damage: count it as damaged (its event, if in range)."""
        self.damage_next = False
        event = None
        if self.in_range(self.ordinal):
            event = SampleEvent(self.ordinal, key, None,
                                TarFormatError("sample follows unreadable tar data", header_offset, key))
        self.drop(damaged_key=key)
        return event


def iter_samples(reader, url: str, *, start: int = 0, stop: int | None = None,
                 resync: bool = False, zero_copy: bool = False) -> Iterator[SampleEvent]:
    """Group tar members into webdataset samples, for sample ordinals ``start <= i < stop``.

    Samples before ``start`` are walked by their headers only (their data is skipped). With
    ``resync`` a damaged region yields an event with ``sample=None`` for the sample it hit and
    parsing goes on at the next valid header; without it, ``TarFormatError`` propagates.
    ``zero_copy`` makes values memoryviews into the mapped file, where the reader allows it.
    """
    return _walk(reader, _Grouping(url, start, stop), resync=resync, zero_copy=zero_copy)


def walk_samples(reader, url: str, *, start: int = 0, stop: int | None = None, resync: bool = False,
                 zero_copy: bool = False) -> tuple[_Grouping, Iterator[SampleEvent | dict]]:
    """``iter_samples`` for the stream's hot path: ``(grouping, events)`` where a whole sample comes as its
    dict alone (its ordinal and key are then the grouping's ``ordinal`` and ``key``), with no event made for
    it; anything else (damage) comes as a ``SampleEvent``."""
    g = _Grouping(url, start, stop)
    return g, _walk(reader, g, resync=resync, zero_copy=zero_copy, plain=True)


def _walk(reader, g: _Grouping, *, resync: bool, zero_copy: bool, plain: bool = False
          ) -> Iterator[SampleEvent | dict]:
    """``iter_samples`` over the grouping ``g`` (which the caller may read afterwards); ``plain``: whole samples
    as their dicts (see ``walk_samples``)."""
    stop = g.stop
    errors: list[TarFormatError] = []
    read_data = reader.read_view if zero_copy and hasattr(reader, "read_view") else reader.read
    key_ext = _KEY_EXT.match
    peek, advance, limit = reader.peek, reader.advance, getattr(reader, "size", None)
    while True:
        header_offset = reader.offset  # next_member's common case, without its call
        header = peek(BLOCK)
        m = _plain_member(header, header_offset, limit) if header is not None else None
        if m is not None:
            advance(BLOCK)
        else:
            try:
                m = next_member(reader, resync=resync, on_error=errors.append)
            except TarTruncated as e:
                if e.complete and g.current is not None:  # cut inside the end-of-archive blocks: the last is whole
                    yield g.current if plain else g.whole()
                raise
            if errors:  # the reader resynchronised past damage: settle which sample it hit
                for err in errors[:-1]:  # refused members (links, sparse) back to back: each is its sample's loss
                    if err.intact:
                        yield from g.damage(err, None)
                yield from g.damage(errors[-1], m[0] if m is not None else None)
                errors.clear()
            if m is None:
                break
        name, size, header_offset = m
        slash = name.rfind("/")
        dot = name.find(".", slash + 1)
        if dot > slash + 1 and (slash < 0 or "\n" not in name):
            # webdataset's rule (``_KEY_EXT``) where it is plain: the key ends at the first dot of the last
            # path component (the regular expression decides the rest: a newline in a folder, a leading dot)
            key, ext = name[:dot], name[dot + 1:]
            match = True
        else:
            match = key_ext(name)
            if match is not None:
                key, ext = match.group(1), match.group(2)
        if match is None or (name[:2] == "__" and is_meta(name)):
            _skip_member(reader, name, size, header_offset)
            continue
        g.members += 1
        if key != g.key:  # the first member of the next sample: the one in progress is complete
            g.count_members()
            if key == g.damaged_key:
                _skip_member(reader, name, size, header_offset, key)
                continue
            if g.current is not None:
                yield g.current if plain else SampleEvent(g.ordinal, g.key, g.current)
            g.begin(key)
            if stop is not None and g.ordinal >= stop:
                return
            if g.damage_next:
                event = g.lost_after_damage(key, header_offset)
                if event is not None:
                    yield event
                _skip_member(reader, name, size, header_offset, key)
                continue
        current = g.current
        if current is None:
            _skip_member(reader, name, size, header_offset, key)
            continue
        ext = ext.lower()
        data = read_data(size)
        if data is None:
            raise TarTruncated(f"tar stream ends inside member {name!r} ({size} bytes expected)", header_offset, key)
        pad = -size & 511  # to the next 512-byte block
        if pad and not reader.skip(pad):
            raise TarTruncated(f"tar stream ends inside the padding of member {name!r}", header_offset, key)
        if ext in current:
            yield SampleEvent(g.ordinal, key, None,
                              TarFormatError(f"duplicate file name {name!r} in sample", header_offset, key))
            g.drop(damaged_key=key)
            continue
        current[ext] = data
    if g.current is not None:
        yield g.current if plain else g.whole()


def count_samples(reader) -> int:
    """The number of samples in a shard, walking headers only (no data is read); damage raises."""
    n, err = count_until_damage(reader)
    if err is not None:
        raise err
    return n


def count_until_damage(reader, *, read_errors: tuple[type[BaseException], ...] = ()
                       ) -> tuple[int, BaseException | None]:
    """``(sample positions, the damage that ends the shard early, or None)``, walking headers only.

    ``read_errors``: exception types of the storage (a read that gave up) that end the count as damage
    does, with the complete samples before them counted; any other exception propagates.

    A damaged header is resynchronised past as a ``skip`` read does (GNU tar's way), and the sample it
    hit keeps its position (the read reports it), so the count matches what a read walks. A shard
    cut short counts the complete samples before the cut: a sample is complete once the header of
    the next sample (or the end-of-archive block) has been read whole. A shard cut inside its
    end-of-archive blocks has every sample whole: it counts them all, with no damage (the read
    reports the cut once).
    """
    g = _Grouping("", 1 << 62, None)
    try:
        for _ in _walk(reader, g, resync=True, zero_copy=False):
            pass
    except TarFormatError as e:
        if getattr(e, "complete", False):
            return g.ordinal + 1, None
        return max(g.ordinal, 0), e
    except read_errors as e:
        return max(g.ordinal, 0), e
    return g.ordinal + 1, None
