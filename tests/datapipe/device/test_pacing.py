"""datapipe.device.pacing: when a paced producer makes its next item."""
import numpy as np
import pytest

from datapipe.device.pacing import Pacer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Stop:
    """A stop event whose wait only records the delay asked for."""

    def __init__(self):
        self.waits = []

    def wait(self, delay):
        self.waits.append(round(delay, 6))
        return False


def _taking(pacer, clock, times, waited=()):
    for t in times:
        clock.now = t
        pacer.took(t in waited)


def _paced(times, waited=()):
    """A pacer at 0.5 on a test clock, after takes at ``times`` (``waited``: those that found nothing)."""
    clock, stop = _Clock(), _Stop()
    pacer = Pacer(0.5, clock=clock)
    _taking(pacer, clock, times, waited)
    return clock, stop, pacer


def test_pacer_holds_the_next_item_until_its_fraction_of_the_consumers_period():
    clock, stop, pacer = _paced([0.0, 0.1])
    pacer.hold(1, stop)  # one gap is not yet a period: no hold
    assert stop.waits == []
    _taking(pacer, clock, [0.2, 0.3])  # one take every 100 ms
    assert abs(pacer.period - 0.1) < 1e-9
    clock.now = 0.301  # the producer got its slot right after the take
    pacer.hold(1, stop)
    assert stop.waits == [0.049]  # until half-way into the step
    pacer.hold(0, stop)  # nothing queued: the consumer would wait for it, so no hold
    clock.now = 0.4
    pacer.hold(1, stop)  # already past the point: no hold
    assert stop.waits == [0.049]


def test_a_pause_does_not_stretch_the_period():
    clock, stop, pacer = _paced([0.0, 0.1, 0.2, 0.3, 60.3, 60.4, 60.5])  # a minute of evaluation in between
    assert abs(pacer.period - 0.1) < 1e-9
    clock.now = 60.5
    pacer.hold(1, stop)
    assert stop.waits == [0.05]


def test_a_consumer_that_waited_turns_holding_off_for_a_while():
    clock, stop, pacer = _paced([0.0, 0.1, 0.2, 0.3], waited={0.3})
    for _ in range(2 * Pacer.SAMPLES):
        pacer.hold(1, stop)
    assert stop.waits == []
    clock.now = 0.3
    pacer.hold(1, stop)
    assert stop.waits == [0.05]


def test_hold_says_when_a_consumers_wait_skipped_it():
    clock, stop, pacer = _paced([0.0, 0.1, 0.2, 0.3])
    assert pacer.hold(1, stop) is False
    _taking(pacer, clock, [0.4], waited={0.4})
    assert all(pacer.hold(1, stop) for _ in range(2 * Pacer.SAMPLES))  # calmed: each one counted
    assert pacer.hold(1, stop) is False


def test_pace_is_checked_and_the_environment_does_not_change_it(monkeypatch):
    from datapipe.device.pacing import check_pace

    monkeypatch.setenv("DATAPIPE_PACE", "0")  # the variable of earlier versions: no effect now
    assert check_pace(0.5) == 0.5 and check_pace(None) is None and check_pace(0) is None
    assert type(check_pace(np.float32(0.25))) is float  # any real number in range
    for bad in (1.5, -0.1, 1, "0.5", True):
        with pytest.raises(ValueError, match="pace="):
            check_pace(bad)
