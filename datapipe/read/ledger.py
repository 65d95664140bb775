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

Who is first is decided under a lock the block's workers share: electing one among processes by plain
shared reads and writes cannot be exact (a worker that has decided but not yet written it looks undecided to
the others, so both count). The marks name the pass by a number the main process gives each pass
(``open_workers``), which every worker takes as it begins the pass (``pass_mark``): persistent workers
rerunning an epoch share no start, and a per-worker count of passes need not agree between workers.
"""
from __future__ import annotations

import json
import multiprocessing
import os
from multiprocessing.context import get_spawning_popen
from typing import Any

from datapipe.errors import LAST_ERRORS, ErrorPolicy

COUNTS = ("samples", "padded", "retries", "shards_opened", "bytes_read", "cache_hits", "cache_failures")
POLICY = ("errors", "skipped")
TEXT_BYTES = 4096  # per worker: its last error messages, as JSON
KEEP_BLOCKS = 2  # blocks of earlier worker sets are folded into plain counts beyond this
SLOTS = 64  # per worker, at least: the split shards whose fault it counted last, as (pass, epoch + 1, shard)
MAX_SLOTS = 4096  # per worker, at most (one a shard of the stream, so no mark of a pass's epoch is wiped)
LOCK_S = 10.0  # a worker waits this long for the marks' lock (one died holding it?), then counts its fault


class Ledger:
    """Counts of one stream: this process's (``counts`` and the policy ``errors``) plus its workers' rows."""

    def __init__(self, errors: ErrorPolicy):
        self.counts = dict.fromkeys(COUNTS, 0)
        self.errors = errors
        # (counts [W, K] int64, text [W, TEXT_BYTES] uint8, faults [W, SLOTS, 3] int64, the faults' lock), shared
        self._blocks: list[tuple[Any, Any, Any, Any]] = []
        self._folded = dict.fromkeys(COUNTS + POLICY, 0)
        self._folded_errors: list[str] = []
        self._row: tuple[Any, Any] | None = None
        self._faults: tuple[Any, int, Any] | None = None  # (the block's fault slots, this worker's id, their lock)
        self._slot = 0
        self._passes = None  # (shared) the number of the main process's last pass with workers
        self._mark = (0, 1)  # (pass, epoch + 1) of the pass being read (begin)
        self._pid: int | None = None
        self._published_errors = 0

    def open_workers(self, num_workers: int, *, again: bool = False, context=None, shards: int = 0) -> None:
        """(Main process, before each DataLoader pass with ``num_workers`` worker processes) number the pass and,
        unless its workers are persistent ones that ran a pass (``again``), give each a shared row; the fault marks'
        lock is of ``context`` (the loader's multiprocessing context, None: the default). A worker keeps a mark for
        each of the stream's ``shards`` (between ``SLOTS`` and ``MAX_SLOTS``): it counts each at most once an epoch,
        so none of its marks of an epoch is wiped while another worker may still look for it."""
        import torch

        if num_workers <= 0:
            return
        if self._passes is None:
            self._passes = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._passes += 1  # before the pass's workers begin it: each takes this number (pass_mark)
        if again and self._blocks:
            return
        self._blocks.append((torch.zeros((num_workers, len(COUNTS) + len(POLICY)), dtype=torch.int64).share_memory_(),
                             torch.zeros((num_workers, TEXT_BYTES), dtype=torch.uint8).share_memory_(),
                             torch.zeros((num_workers, min(MAX_SLOTS, max(SLOTS, shards)), 3),
                                         dtype=torch.int64).share_memory_(),
                             (context or multiprocessing.get_context()).Lock()))
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
        self._faults = (block[2], worker_id, block[3]) if here else None
        self._blocks, self._folded_errors = [], []
        self._folded = dict.fromkeys(self._folded, 0)
        for k in self.counts:
            self.counts[k] = 0
        self.errors.reset()
        self._published_errors = 0
        return True

    def pass_mark(self, epoch: int) -> tuple[int, int]:
        """(As a pass begins: ``iter()``) what names it in the fault marks: the main process's pass number, and
        ``epoch + 1`` (a ``mix`` restarts a stream at the next epoch within its pass)."""
        return (int(self._passes[0]) if self._passes is not None else 0), int(epoch) + 1

    def begin(self, mark: tuple[int, int]) -> None:
        """(Each pass, as it is first read) the :meth:`pass_mark` that :meth:`first_fault` marks."""
        self._mark = tuple(mark)

    def first_fault(self, shard: int) -> bool:
        """(A worker that cannot read its part of ``shard``, which other workers read too) True when it counts
        the error: no worker has marked this shard's fault in this pass. The look and the mark are made under
        the block's lock, so exactly one worker counts it (without the lock, as in a copy that was not started
        with it, or after waiting ``LOCK_S``: counted here, at worst twice)."""
        if self._faults is None:
            return True
        faults, me, lock = self._faults
        key = faults.new_tensor([*self._mark, shard])
        if lock is None or not lock.acquire(timeout=LOCK_S):
            return True
        try:
            if bool((faults == key).all(-1).any()):
                return False
            faults[me, self._slot % faults.shape[1]] = key
            self._slot += 1
            return True
        finally:
            lock.release()

    def __getstate__(self) -> dict[str, Any]:
        """A lock travels only to a process being started (a DataLoader worker); other copies go without it."""
        state = dict(self.__dict__)
        if get_spawning_popen() is None:
            state["_blocks"] = [block[:3] + (None,) for block in self._blocks]
            state["_faults"] = self._faults and self._faults[:2] + (None,)
        return state

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

