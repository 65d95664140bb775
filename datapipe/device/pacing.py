"""Pacing a producer thread to its consumer: the next item starts only part-way into the consumer's step.

A producer woken the moment the consumer takes an item competes for the GIL with the training
thread while it launches its step; :class:`Pacer` holds it back. Each loader chooses its fraction
(:data:`PACE`, :data:`IMAGE_PACE`); there is no user setting.
"""
from __future__ import annotations

import numbers
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["IMAGE_PACE", "PACE", "Pacer", "check_pace"]


class Pacer:
    """Holds the producer's next item back until ``fraction`` of the consumer's step has passed.

    The consumer's ``next()`` frees a slot at the start of its step, exactly when its own thread
    launches that step's work; a producer starting at once competes with it for the GIL. With an
    item still queued there is slack: the producer waits until ``fraction`` of the consumer's
    period after the last take. The period is the median of the last ``SAMPLES`` gaps between
    takes (a pause for evaluation or a checkpoint does not move it), and after any take that
    found nothing ready the producer does not hold at all for ``2 * SAMPLES`` items.
    """

    MAX_DELAY_S = 0.5
    SAMPLES = 8

    def __init__(self, fraction: float, clock: Callable[[], float] = time.perf_counter):
        self.fraction = fraction
        self.clock = clock
        self.taken: float | None = None
        self.period: float | None = None
        self.calm = 0  # items left to make without holding (after the consumer had to wait)
        self._gaps: deque[float] = deque(maxlen=self.SAMPLES)

    def took(self, waited: bool = False) -> None:
        """(Consumer) an item was just taken; ``waited``: none was ready when it asked."""
        now = self.clock()
        if self.taken is not None:
            self._gaps.append(now - self.taken)
            if len(self._gaps) >= 3:
                gaps = sorted(self._gaps)
                self.period = gaps[len(gaps) // 2]
        self.taken = now
        if waited:
            self.calm = 2 * self.SAMPLES

    def hold(self, queued: int, stop: threading.Event) -> bool:
        """(Producer) wait, if an item is still queued, until the consumer is ``fraction`` into its step.
        True: not held because a take that found nothing ready turned holding off (``calm``)."""
        if self.calm > 0:
            self.calm -= 1
            return True
        taken, period = self.taken, self.period
        if queued < 1 or taken is None or period is None:
            return False
        delay = taken + self.fraction * min(period, self.MAX_DELAY_S) - self.clock()
        if delay > 0:
            stop.wait(delay)
        return False


# The pace of each loader, chosen by the loader (no user setting): the fractions that measured best.
PACE = 0.5  # DevicePrefetcher's producer (loaders.DataLoader, TokenLoader)
IMAGE_PACE = 0.7  # ImageLoader's DALI producer: its work is then launched after the step's own kernels


def check_pace(pace: float | None) -> float | None:
    """``pace`` checked (a fraction in [0, 1) of the consumer's step): the fraction, or None when off (None or 0)."""
    if pace is not None and (isinstance(pace, bool) or not isinstance(pace, numbers.Real) or not 0 <= pace < 1):
        raise ValueError(f"pace={pace!r}: use a fraction in [0, 1) of the consumer's step, or None (0 and None turn "
                         "pacing off)")
    return None if pace is None else float(pace) or None
