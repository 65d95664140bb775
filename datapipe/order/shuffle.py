"""A seeded shuffle buffer whose state can be rebuilt from a draw count alone.

The buffer's choices depend only on its random generator and the number of items seen, never
on the items. So resuming after ``d`` draws needs no saved samples: running the same buffer
over item *positions* tells which positions sit in which slots, and the reader re-reads just those.
"""
from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Iterable, Iterator


START = 128  # items a stream's buffer holds before its first draw (it fills up to its size while it draws)


class ShuffleBuffer:
    """Reservoir-style shuffle: fill ``size`` slots, then each new item replaces a random slot's item.

    ``start``: draw from the first ``start`` items on, one draw for every second item pulled, until the
    buffer holds ``size`` (so the first item comes after ``start`` reads, not ``size``); None: fill all
    ``size`` slots first. ``pulled``: items a resumed buffer had pulled before (with its ``slots`` and its
    generator's state). The choices depend only on the generator and the count of items pulled.
    """

    def __init__(self, size: int, rng: random.Random, slots: list | None = None, *, start: int | None = None,
                 pulled: int = 0):
        self.size = size
        self.rng = rng
        self.slots = list(slots or [])
        self.start = size if start is None else max(1, min(start, size))
        self.pulled = pulled

    def run(self, source: Iterable[Any]) -> Iterator[Any]:
        slots, rng, size, start = self.slots, self.rng, self.size, self.start
        source = iter(source)
        for item in (source if len(slots) < size else ()):  # filling up
            self.pulled += 1
            n = len(slots)
            slots.append(item)
            # no draw before ``start`` items, then one every second item; filled before its first draw
            # (``start == size``): the first draw replaces with the next item
            if not (n + 1 < start or (start < size and self.pulled % 2) or (n + 1 == size and start == size)):
                j = rng.randrange(n + 1)
                slots[j], slots[-1] = slots[-1], slots[j]
                yield slots.pop()
            if len(slots) >= size:
                break
        # full: each item replaces a random slot's item; ``rng.randrange(size)``'s own draws (getrandbits of
        # size's bit length until one is below size) without its Python-level argument checks
        getrandbits, bits = rng.getrandbits, size.bit_length()
        for item in source:
            self.pulled += 1
            j = getrandbits(bits)
            while j >= size:
                j = getrandbits(bits)
            out = slots[j]
            slots[j] = item
            yield out
        while slots:
            j = rng.randrange(len(slots))
            slots[j], slots[-1] = slots[-1], slots[j]
            yield slots.pop()


def replay_positions(size: int, seed: int, length: int, draws: int) -> tuple[ShuffleBuffer, int]:
    """The buffer after ``draws`` draws over positions ``0..length-1``, and the next position to pull.

    The returned buffer's ``slots`` hold positions; its generator is in the same state as a live
    buffer's after the same draws.
    """
    buffer = ShuffleBuffer(size, random.Random(seed), start=START)
    consumed = sum(1 for _ in itertools.islice(buffer.run(range(length)), draws))
    if consumed != draws:
        raise ValueError(f"cannot resume after {draws} draws: this run has only {consumed} items")
    return buffer, buffer.pulled


def drawn_position(size: int, seed: int, length: int, draw: int) -> int:
    """The position that draw number ``draw`` (1: the first) hands out, over positions ``0..length-1``."""
    buffer = ShuffleBuffer(size, random.Random(seed), start=START)
    return next(itertools.islice(buffer.run(range(length)), draw - 1, None))


def shuffled(read_positions: Callable[..., Iterator[tuple[int, Any]]], *, size: int, seed: int, length: int,
             draws: int, read_items: Callable[[int], Iterator[Any]] | None = None) -> Iterator[Any]:
    """The shuffle-buffer stage: items of a run of ``length`` positions from draw ``draws`` on.

    ``read_positions(first, keep)`` yields ``(position, item)`` from position ``first`` on; where
    ``keep(position)`` is false the item need not be read (any placeholder will do). The buffer is
    rebuilt by replaying ``draws`` draws over positions; the items in its slots are read again, and the
    positions between them that were drawn before are passed over.
    ``read_items(first)``, if given, yields the items alone: an empty buffer to rebuild (a fresh epoch)
    reads through it, with no position attached to every item.
    """
    buffer, pulled = replay_positions(size, seed, length, draws)
    if not buffer.slots and read_items is not None:
        yield from ShuffleBuffer(size, buffer.rng, start=START, pulled=pulled).run(read_items(pulled))
        return
    wanted = {p: i for i, p in enumerate(buffer.slots)}
    source = read_positions(min(buffer.slots + [pulled]), lambda p: p >= pulled or p in wanted)
    slots = [None] * len(buffer.slots)
    while wanted:
        pos, item = next(source)
        if pos in wanted:
            slots[wanted.pop(pos)] = (pos, item)
    live = ShuffleBuffer(size, buffer.rng, slots, start=START, pulled=pulled)
    for _, item in live.run(item for item in source if item[0] >= pulled):
        yield item
