"""The last stage of a worker's run: count each draw, drop what was lost, or pad it for equal counts.

Every rank must yield the same number of samples per epoch (DDP hangs otherwise). A sample that
could not be read (or decoded) leaves a LOST item in its place. Alone (``pad=False``) the stage drops
it; across ranks (``pad=True``) it hands out a repeat of the sample this worker delivered last instead
(counted as ``padded``), so the rank still yields its planned count. Losses before the worker's first
sample are repaid by repeats of that sample, right after it. A worker that delivers no sample at all (its
whole share lost) repeats a stand-in that ``stand_in()`` chooses among its rank's other samples
(:mod:`datapipe.read.standin`), which raises a ``DataError`` when the rank has none to repeat.

The position records what a resume needs to hand out the same repeats: ``last``, the draw of the
sample delivered last (a resumed pass reads it again when a lost item comes before any sample of its
own), and ``owed``, the repeats still owed for losses before the first sample.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

log = logging.getLogger("datapipe").getChild("stream")

PADDING_KEYS = ("last", "owed")  # a worker position's entries besides ``draws`` and ``done``: ints, where set


def deliver(items: Iterable[Any], position: dict[str, Any], counts: dict[str, int], *, lost: Any,
            pad: bool, reread: Callable[[int], Any] | None = None,
            stand_in: Callable[[], Any] | None = None) -> Iterator[Any]:
    """``items`` with each ``lost`` one dropped (or, with ``pad``, replaced by a repeat of a delivered sample).

    ``position["draws"]`` counts the items drawn (the worker's resume point); with ``pad`` also
    ``position["last"]`` (the draw of the sample delivered last) and ``position["owed"]`` (repeats still
    owed, while any are). ``reread(draw)`` gives the sample of an earlier draw again (None if it is lost
    now): a pass resumed after ``last`` repeats it. ``stand_in()``: the sample to repeat for the repeats still
    owed at the end (none of this worker's own was delivered to repeat); it is chosen again, the same, by a
    pass resumed among those repeats. ``counts``: the samples (``"samples"``) and repeats (``"padded"``)
    handed out.
    """
    sample = None  # the sample a lost one repeats
    if pad and position.get("owed") and position.get("last") and reread is not None:
        sample = reread(position["last"])  # resumed among the repeats owed
        if sample is not None:
            yield from _repay(sample, position, counts)
    for item in items:
        position["draws"] += 1
        if item is lost:
            if not pad:
                continue
            if sample is None and position.get("last") and reread is not None:
                sample = reread(position["last"])  # resumed: the sample delivered last before the resume
            if sample is None:
                position["owed"] = position.get("owed", 0) + 1
                continue
            counts["padded"] += 1
            yield sample
            continue
        counts["samples"] += 1
        if not pad:
            yield item
            continue
        sample = item
        position["last"] = position["draws"]
        yield item
        if "owed" in position:
            yield from _repay(item, position, counts)
    if pad and position.get("owed") and stand_in is not None:
        yield from _repay(stand_in(), position, counts)  # the whole share lost: a sample of the rank's others
    if position.get("owed"):
        log.warning("%d samples of this rank were lost and none was delivered to repeat: this rank yields "
                    "fewer samples than the others", position["owed"])


def _repay(sample: Any, position: dict[str, Any], counts: dict[str, int]) -> Iterator[Any]:
    """The repeats of ``sample`` still owed, each counted out of the position before it is handed out."""
    while position.get("owed"):
        owed = position.pop("owed") - 1
        if owed:
            position["owed"] = owed
        counts["padded"] += 1
        yield sample
