import itertools
import random

import pytest

from datapipe.order.shuffle import START, ShuffleBuffer, replay_positions, shuffled


class Counting:
    """A source that counts the items pulled from it."""

    def __init__(self, n):
        self.n, self.pulled = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.pulled += 1
            yield i


@pytest.mark.parametrize("size", [1, 5, START, 1000])
def test_the_first_draw_comes_after_start_items_not_the_whole_buffer(size):
    source = Counting(5000)
    it = ShuffleBuffer(size, random.Random(0), start=START).run(source)
    first = next(it)
    assert source.pulled <= min(size, START) + 1
    assert sorted([first] + list(it)) == list(range(5000))  # every item, once


def test_without_start_the_buffer_fills_before_its_first_draw():
    source = Counting(100)
    it = ShuffleBuffer(10, random.Random(0)).run(source)
    next(it)
    assert source.pulled == 11


@pytest.mark.parametrize("size,length", [(1000, 3000), (7, 50), (300, 200)])
def test_resume_from_a_draw_count_gives_the_same_rest(size, length):
    full = list(ShuffleBuffer(size, random.Random(3), start=START).run(range(length)))
    assert sorted(full) == list(range(length))
    for draws in (0, 1, START // 2, START + 1, 2 * START + 7, length // 2, length - 1):
        if draws > length:
            continue
        buffer, pulled = replay_positions(size, 3, length, draws)
        def read(first, keep):  # a position not kept is not read: a placeholder that must never come out
            return ((p, p if keep(p) else None) for p in range(first, length))

        rest = list(shuffled(read, size=size, seed=3, length=length, draws=draws))
        assert rest == full[draws:], draws
        assert list(itertools.islice(ShuffleBuffer(size, random.Random(3), start=START).run(range(length)),
                                     draws)) == full[:draws]
