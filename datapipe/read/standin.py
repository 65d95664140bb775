"""The stand-in for a worker whose whole share of the epoch is lost under DDP: a sample of its rank to repeat.

Padding (:mod:`datapipe.order.padding`) repeats a sample the worker delivered itself. When it delivered none
(every shard it was given is unreadable), the rank would come up short and a DDP collective hang, so the
worker repeats the first readable sample of its rank's other workers' runs instead: in the order of those
workers after it (``worker + 1``, ``worker + 2``, ... wrapping), each run in plan order. The choice depends only
on the plan and on what can be read, so a resume from any state makes it again. Those reads are quiet: the
losses they meet belong to the other workers, which count them. A rank with no readable sample at all has
nothing to repeat: a ``DataError`` says so instead of a short epoch.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from datapipe.decode import stepped
from datapipe.errors import DataError, ErrorPolicy
from datapipe.order.plan import WorkerPlan
from datapipe.read.ledger import Ledger
from datapipe.read.segments import LOST, SegmentReader


def stand_in(reader: SegmentReader, plan_of: Callable[[int], WorkerPlan], *, worker: int, num_workers: int,
             steps: Sequence[Any] = (), rank: int = 0, world_size: int = 1) -> Any:
    """The first readable sample (after ``steps``) of the runs of ``worker``'s rank's other workers
    (``plan_of(worker=w)``), taken in the order ``worker + 1, worker + 2, ...`` (mod ``num_workers``); a ``DataError``
    when there is none (nor in the worker's own run, which is lost: the rank has no readable sample)."""
    quiet = SegmentReader(reader.shards, zero_copy=False, read_threads=0)
    quiet.ledger = Ledger(ErrorPolicy("skip"))  # the losses met here are counted by the workers that own them
    workers = max(1, num_workers)
    for w in [(worker + i) % workers for i in range(1, workers)]:
        read = quiet.items(plan_of(worker=w), 0)
        items = stepped(read, steps, lost=LOST, lose=quiet.lose) if steps else read
        try:
            for item in items:
                if item is not LOST:
                    return item
        finally:
            items.close()  # the shard in hand is closed now, not when the generator is collected
            read.close()
    raise DataError(f"rank {rank} of {world_size} has no readable sample this epoch (every shard of its share is "
                    "unreadable or every sample lost), so it cannot repeat one to yield as many samples as the other "
                    "ranks, and a short epoch would hang a DDP collective: fix or remove the damaged shards")
