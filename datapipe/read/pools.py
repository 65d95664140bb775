"""This process's thread pools, one per purpose: made on first use, made anew with more threads when more are
asked for, and made afresh in a forked child (which inherits none of the parent's threads)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}  # thread name prefix -> (pid, pool)
_lock = threading.Lock()


def process_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The pool of threads named ``name`` in this process, with at least ``threads`` threads."""
    with _lock:
        pid, pool = _pools.get(name, (None, None))
        if pool is None or pid != os.getpid() or pool._max_workers < threads:
            pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
            _pools[name] = (os.getpid(), pool)
        return pool


def current(name: str) -> ThreadPoolExecutor | None:
    """The pool ``process_pool(name, ...)`` last made in this process, or None."""
    pid, pool = _pools.get(name, (None, None))
    return pool if pid == os.getpid() else None
