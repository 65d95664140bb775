"""The last stage of a worker's run: count each draw, drop what was lost, or pad it for equal counts.

Every rank must yield the same number of samples per epoch (DDP hangs otherwise). A sample that
could not be read (or decoded) leaves a LOST item in its place. Alone (``pad=False``) the stage drops
it; across ranks (``pad=True``) it hands out a repeat of a sample this worker delivered instead
(counted as ``padded``), so the rank still yields its planned count.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

log = logging.getLogger("datapipe").getChild("stream")


def deliver(items: Iterable[Any], position: dict[str, Any], counts: dict[str, int], *, lost: Any,
            pad: bool) -> Iterator[Any]:
    """``items`` with each ``lost`` one dropped (or, with ``pad``, replaced by a repeat of a delivered sample).

    ``position["draws"]`` counts the items drawn (the worker's resume point), ``counts`` the samples
    (``"samples"``) and repeats (``"padded"``) handed out.
    """
    last, owed = None, 0
    for item in items:
        position["draws"] += 1
        if item is lost:
            if not pad:
                continue
            if last is None:
                owed += 1
                continue
            counts["padded"] += 1
            yield last
            continue
        counts["samples"] += 1
        yield item
        if pad:
            last = item
            for _ in range(owed):
                counts["padded"] += 1
                yield item
            owed = 0
    if owed:
        log.warning("%d samples of this rank were lost and none was delivered to repeat: this rank yields "
                    "fewer samples than the others", owed)
