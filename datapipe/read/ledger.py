"""The one loss ledger: what a stream read and lost, counted once over every process that reads it.

The process that iterates a stream counts into its ledger (``counts``) and its ``on_error`` policy
(``errors``, ``skipped``, ``last_errors``). DataLoader worker processes read copies of the stream:
before it starts them, the loader calls ``open_workers(n)`` in the main process, which gives each
worker one row of shared memory. A worker's copy counts from zero (:meth:`Ledger.enter`) and writes
its counts into its row (:meth:`Ledger.publish`) after every shard, every error and at the end of its
run, so a loss is visible in the main process even when no batch follows it. :meth:`Ledger.totals`
adds every worker's row to the main process's own counts: each loss is counted once, wherever it
happened. A shard split between workers is opened by each (``shards_opened`` counts openings); when it
cannot be read, the first worker to say so counts the error (:meth:`Ledger.first_fault`), the others
only their lost samples, so ``errors`` is the same with any number of workers.
"""
from __future__ import annotations

import json
import os
from typing import Any

from datapipe.errors import LAST_ERRORS, ErrorPolicy

COUNTS = ("samples", "padded", "retries", "shards_opened", "bytes_read", "cache_hits", "cache_failures")
POLICY = ("errors", "skipped")
TEXT_BYTES = 4096  # per worker: its last error messages, as JSON
KEEP_BLOCKS = 2  # blocks of earlier worker sets are folded into plain counts beyond this
SLOTS = 4  # per worker: the split shards it last found unreadable, as (epoch + 1, shard, state)
CLAIMED, COUNTED, LEFT = 1, 2, 3  # a slot's state (Ledger.first_fault)


class Ledger:
    """Counts of one stream: this process's (``counts`` and the policy ``errors``) plus its workers' rows."""

    def __init__(self, errors: ErrorPolicy):
        self.counts = dict.fromkeys(COUNTS, 0)
        self.errors = errors
        # (counts [W, K] int64, text [W, TEXT_BYTES] uint8, faults [W, SLOTS, 3] int64), shared
        self._blocks: list[tuple[Any, Any, Any]] = []
        self._folded = dict.fromkeys(COUNTS + POLICY, 0)
        self._folded_errors: list[str] = []
        self._row: tuple[Any, Any] | None = None
        self._faults: tuple[Any, int] | None = None  # (the block's fault slots, this worker's id)
        self._slot = 0
        self._epoch = 0
        self._pid: int | None = None
        self._published_errors = 0

    def open_workers(self, num_workers: int) -> None:
        """(Main process, before a DataLoader starts ``num_workers`` worker processes) one shared row each."""
        import torch

        if num_workers <= 0:
            return
        self._blocks.append((torch.zeros((num_workers, len(COUNTS) + len(POLICY)), dtype=torch.int64).share_memory_(),
                             torch.zeros((num_workers, TEXT_BYTES), dtype=torch.uint8).share_memory_(),
                             torch.zeros((num_workers, SLOTS, 3), dtype=torch.int64).share_memory_()))
        while len(self._blocks) > KEEP_BLOCKS:  # those workers have ended: their counts stay, their memory goes
            counts, errors = self._read_block(self._blocks.pop(0))
            for k, v in counts.items():
                self._folded[k] += v
            self._folded_errors = (self._folded_errors + errors)[-LAST_ERRORS:]

    def enter(self, worker_id: int) -> bool:
        """(In a worker) count from zero into row ``worker_id``; True when this process enters for the first time."""
        if self._pid == os.getpid():
            return False
        self._pid = os.getpid()
        block = self._blocks[-1] if self._blocks else None
        here = block is not None and worker_id < len(block[0])
        self._row = (block[0][worker_id], block[1][worker_id]) if here else None
        self._faults = (block[2], worker_id) if here else None
        self._blocks, self._folded_errors = [], []
        self._folded = dict.fromkeys(self._folded, 0)
        for k in self.counts:
            self.counts[k] = 0
        self.errors.reset()
        self._published_errors = 0
        return True

    def begin(self, epoch: int) -> None:
        """(Each pass) the epoch that :meth:`first_fault` marks; this worker's marks of earlier passes go."""
        self._epoch = int(epoch)
        if self._faults is not None:
            self._faults[0][self._faults[1]].zero_()

    def first_fault(self, shard: int) -> bool:
        """(A worker that cannot read its part of ``shard``, which other workers read too) True when it counts
        the error: no other worker has counted this shard's fault in this epoch. Each worker marks its claim,
        then looks at the others': a counted one, or an earlier worker's claim, leaves the error to them. (A
        race can only count it twice, never lose it.)"""
        if self._faults is None:
            return True
        faults, me = self._faults
        mine = faults[me, self._slot % SLOTS]
        self._slot += 1
        mine.copy_(faults.new_tensor([self._epoch + 1, shard, CLAIMED]))
        hit = (faults[..., 0] == self._epoch + 1) & (faults[..., 1] == shard)
        hit[me] = False
        others = zip(hit.nonzero()[:, 0].tolist(), faults[..., 2][hit].tolist())
        first = not any(state == COUNTED or (state == CLAIMED and w < me) for w, state in others)
        mine[2] = COUNTED if first else LEFT
        return first

    def publish(self) -> None:
        """(In a worker) write this worker's counts (and, after new errors, its last messages) into its row."""
        if self._row is None:
            return
        import torch

        counts_row, text_row = self._row
        counts_row.copy_(torch.tensor([self.counts[k] for k in COUNTS] + [self.errors.errors, self.errors.skipped],
                                      dtype=torch.int64))
        if self.errors.errors != self._published_errors:
            self._published_errors = self.errors.errors
            messages = list(self.errors.last_errors)
            data = json.dumps(messages).encode()
            while len(data) > TEXT_BYTES and messages:
                messages = messages[1:] if len(messages) > 1 else [messages[0][: TEXT_BYTES // 2]]
                data = json.dumps(messages).encode()
            text_row.zero_()
            text_row[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    @staticmethod
    def _read_block(block) -> tuple[dict, list[str]]:
        counts, text = block[:2]
        sums = counts.sum(0).tolist()
        out = dict(zip(COUNTS + POLICY, sums))
        errors: list[str] = []
        for row in text:
            raw = bytes(row.numpy().tobytes()).rstrip(b"\0")
            if raw:
                try:
                    errors += json.loads(raw.decode())
                except ValueError:  # a row caught mid-write: its messages come with the next read
                    pass
        return out, errors

    def totals(self) -> dict[str, Any]:
        """This process's counts plus every worker's: the stream's ``stats()`` counts."""
        out = {**{k: self.counts[k] for k in COUNTS}, "errors": self.errors.errors, "skipped": self.errors.skipped}
        errors = list(self._folded_errors)
        for k, v in self._folded.items():
            out[k] += v
        for block in self._blocks:
            counts, messages = self._read_block(block)
            for k, v in counts.items():
                out[k] += v
            errors += messages
        out["last_errors"] = (errors + list(self.errors.last_errors))[-LAST_ERRORS:]
        return out

