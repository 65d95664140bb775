"""How much of each batch ImageLoader decodes on the CPU while the GPU decodes the rest.

The loader's own GPU kernels (nvJPEG colour conversion, resize) slow a GPU-bound training step
that runs beside them (README, "ceiling"). Cores that sit idle can take part of that work: DALI
decodes, crops and resizes ``k`` images of each batch on its CPU threads, the other images go to
the GPU as before, and the two halves are merged back in their original order. ``HostShare``
decides ``k``: fixed (``cpu_share=0.4``) or ``"auto"``, which keeps DALI's CPU threads about
``TARGET_BUSY`` busy (their CPU time, read from ``/proc``) and backs off when the consumer waits.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np

TARGET_BUSY = 0.75  # the DALI CPU threads' busy fraction "auto" aims at: headroom for bursts
MAX_SHARE = 0.75  # never more than this share of a batch on the CPU
WINDOW = 4  # batches between two decisions of "auto"
WAIT_BACKOFF = 0.02  # consumer waiting more than this fraction of a window: fewer images on the CPU


def dali_pool_threads(pid: int | None = None) -> set[int]:
    """Thread ids of DALI's CPU worker pools (``[DALI][TP<n>]...``) in this process; empty off Linux."""
    root = f"/proc/{pid or os.getpid()}/task"
    found = set()
    try:
        tids = os.listdir(root)
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"{root}/{tid}/comm") as f:
                if f.read().startswith("[DALI][TP"):
                    found.add(int(tid))
        except OSError:
            continue
    return found


def threads_cpu_seconds(tids: set[int]) -> float:
    """User + system CPU seconds the given threads of this process have used (those still alive)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


class HostShare:
    """The number of images per batch DALI decodes on the CPU: fixed, or steered by ``"auto"``.

    ``predicates()`` is DALI's external source for the split (one bool per image, ``True`` = CPU);
    it runs once per pipeline iteration, in the thread that runs the pipeline. Make the HostShare
    just before its pipeline is built: ``"auto"`` takes the DALI pool threads that appear after
    that as the pipeline's; ``waited()`` returns the consumer's total wait in seconds so far.
    """

    def __init__(self, batch_size: int, share: float | str, waited: Callable[[], float] | None = None):
        if share != "auto" and not (isinstance(share, (int, float)) and 0.0 <= share <= 1.0):
            raise ValueError(f"cpu_share must be 'auto' or a number in [0, 1], got {share!r}")
        self.batch_size = int(batch_size)
        self.auto = share == "auto"
        self.limit = int(MAX_SHARE * self.batch_size) if self.auto else self.batch_size
        self.k = self.limit // 3 if self.auto else int(round(float(share) * self.batch_size))
        self._waited = waited
        self._before = dali_pool_threads() if self.auto else set()
        self._threads: set[int] | None = None
        self._lock = threading.Lock()
        self._calls = 0
        self._mark: tuple[float, float, float] | None = None  # (wall, pool CPU seconds, consumer wait)
        self.history: list[tuple[int, float]] = []  # (k, busy fraction) at each decision of "auto"

    @property
    def share(self) -> float:
        """The current share of a batch decoded on the CPU."""
        return self.k / self.batch_size

    def predicates(self) -> list[np.ndarray]:
        """DALI's external source (no arguments): one bool per image of a full batch."""
        return self.predicates_for(self.batch_size)

    def predicates_for(self, n: int) -> list[np.ndarray]:
        """One 0-d bool per image of a batch of ``n``: the first ``k`` on the CPU."""
        with self._lock:
            self._calls += 1
            if self.auto and self._calls % WINDOW == 0:
                self._steer()
            k = min(self.k, n)
        return [np.array(i < k) for i in range(n)]

    def _steer(self) -> None:
        """(``"auto"``, every ``WINDOW`` batches) measure the last window and move ``k``."""
        if self._threads is None:
            self._threads = dali_pool_threads() - self._before  # the pipeline's pool, built by now
        if not self._threads:
            return
        now = (time.perf_counter(), threads_cpu_seconds(self._threads), float(self._waited() if self._waited else 0.0))
        last, self._mark = self._mark, now
        if last is None or now[0] <= last[0]:
            return
        wall = now[0] - last[0]
        self.decide(busy=(now[1] - last[1]) / (len(self._threads) * wall), waited=(now[2] - last[2]) / wall)

    def decide(self, *, busy: float, waited: float) -> None:
        """New ``k`` from the DALI CPU threads' ``busy`` fraction and the consumer's ``waited`` fraction."""
        self.history.append((self.k, round(busy, 3)))
        if waited > WAIT_BACKOFF and busy > TARGET_BUSY / 2 and self.k > 0:  # the CPU half is late
            self.k = int(self.k * 0.7)
        elif self.k == 0:
            self.k = max(1, self.limit // 8)  # probe again: the CPU may have room now
        else:
            wanted = min(self.k * TARGET_BUSY / max(busy, 1e-3), 2 * self.k, self.limit)  # at most double
            self.k = int(round(0.5 * self.k + 0.5 * wanted))
