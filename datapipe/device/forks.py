"""Forked children never run the parent's destructors through the garbage collector.

A forked worker (torch's DataLoader, ``multiprocessing``) inherits a copy of every object of the
parent, including garbage in reference cycles the parent has not collected yet. If the child's
collector frees one, its destructor runs in the child: a CUDA tensor calls into a CUDA context the
child cannot use (abort), a DALI pipeline joins threads that exist only in the parent (segfault),
a buffered file flushes the parent's data a second time. So, once :func:`install` ran (the loaders
call it on first use: when a producer thread starts, when a DataLoader starts its workers; never
at import), every ``os.fork`` freezes the collector's objects (``gc.freeze``) just before and
thaws them again in the parent only, and the child freezes everything it inherited once more as
its first step (objects another thread made after the parent's freeze are inherited too). A process
that froze objects itself is left as it is; its collector is then held off (``gc.disable``) from
just before the fork until the child has frozen what it inherited (in the parent: until the fork).
"""
from __future__ import annotations

import gc
import os
import threading

_state: dict = {"installed": False, "forks": {}}  # forks: thread id -> (froze, held) of its fork in progress


def _before_fork() -> None:
    froze = gc.get_freeze_count() == 0 and not _state["forks"]
    held = not froze and gc.isenabled()  # frozen already (by the process, or another thread's fork)
    if froze:
        gc.freeze()
    elif held:
        gc.disable()
    _state["forks"][threading.get_ident()] = (froze, held)


def _after_fork_in_parent() -> None:
    froze, held = _state["forks"].pop(threading.get_ident(), (False, False))
    if froze:
        gc.unfreeze()
    if held:
        gc.enable()


def _after_fork_in_child() -> None:
    gc.freeze()  # every inherited object, however the parent's freeze went: this process never collects them
    froze, held = _state["forks"].get(threading.get_ident(), (False, False))
    _state["forks"] = {}
    if held:
        gc.enable()


def install() -> None:
    """Register the fork hooks (once per process)."""
    if _state["installed"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
    _state["installed"] = True
