"""The local engine of ``datapipe shard``: partitions in a process pool on this machine.

Pool workers die with the job: on Linux each asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), elsewhere a thread watches the parent's pid; they ignore Ctrl-C, which
the job handles (it stops the pool and says how to resume).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

from datapipe.jobs.shard.partition import run_partition

CHECK_POOL_MIN_ITEMS = 256  # fewer images are checked in the writing process (a pool costs more)
# an "open" check (header and end marker, ~0.05 ms an image) pays for the pool's start (~0.1-0.3 s: forking a
# process that imported torch, each worker reading the files again) only for this many times more images
OPEN_CHECK_POOL_FACTOR = 16
_PR_SET_PDEATHSIG = 1

_progress_queue = None  # set in pool workers by _init_worker only


def die_with_parent(parent: int) -> None:
    """Make this (worker) process end when the process ``parent`` ends, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
        if armed:
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)
            return

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="datapipe-parent-watch", daemon=True).start()


def _init_worker(queue, parent: int, lock_fd: int | None) -> None:
    global _progress_queue
    _progress_queue = queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle
    die_with_parent(parent)
    if lock_fd is not None:  # the output lock is the job's, not a worker's to keep after the job
        try:
            os.close(lock_fd)
        except OSError:
            pass


def _pool_run(job: dict, part: dict) -> dict:
    queue = _progress_queue
    report = (lambda n, b: queue.put((n, b))) if queue is not None else None
    return run_partition(job, part, report)


def _kill(pool) -> None:
    """Stop a ProcessPoolExecutor's workers now (not after their running partitions)."""
    pool.shutdown(wait=False, cancel_futures=True)
    for p in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            p.kill()
        except Exception:
            pass


def run_local(job: dict, parts: list[dict], *, workers: int, progress: Callable[[int, int], None],
              lock_fd: int | None = None) -> Iterator[dict]:
    """Run partitions in a process pool (in this process when ``workers == 1``); yield done markers.

    Copy jobs (image bytes kept as they are) write in this process, one shard-sized partition
    after the other, and spread only the image checks over ``workers`` processes: writing a
    shard costs less than checking its images, and no partition leaves a tail to merge.
    ``lock_fd``: the output lock's descriptor, which the workers close.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    if ctx.get_start_method() != "fork":
        lock_fd = None  # a spawned worker inherits no descriptor (that number may be another file there)
    items = sum(len(p.get("items", ())) for p in parts)
    pool_min = CHECK_POOL_MIN_ITEMS * (OPEN_CHECK_POOL_FACTOR if job["check_images"] == "open" else 1)
    if job.get("copy") and job["check_images"] != "none" and workers > 1 and items >= pool_min:
        with ctx.Pool(workers, initializer=_init_worker, initargs=(None, os.getpid(), lock_fd)) as pool:
            for part in parts:  # leaving the block (also by an exception) terminates the workers
                yield run_partition(job, part, progress, check_pool=pool)
        return
    if workers <= 1 or len(parts) <= 1:
        for part in parts:
            yield run_partition(job, part, progress)
        return
    import queue as queuelib
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    q = ctx.Queue()

    def drain():
        while True:
            try:
                progress(*q.get_nowait())
            except queuelib.Empty:
                return

    todo = list(parts)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(q, os.getpid(), lock_fd))
    try:
        running = set()
        while todo or running:
            while todo and len(running) < 2 * workers:  # bounded: a few partitions in flight
                running.add(pool.submit(_pool_run, job, todo.pop(0)))
            done, running = wait(running, timeout=0.2, return_when=FIRST_COMPLETED)
            drain()
            for fut in done:
                yield fut.result()  # re-raises a worker's exception here
    except BaseException:
        _kill(pool)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        drain()
