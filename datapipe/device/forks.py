"""Forked children never run the parent's destructors through the garbage collector.

A forked worker (torch's DataLoader, ``multiprocessing``) inherits a copy of every object of the
parent, including garbage in reference cycles the parent has not collected yet. If the child's
collector frees one, its destructor runs in the child: a CUDA tensor calls into a CUDA context the
child cannot use (abort), a DALI pipeline joins threads that exist only in the parent (segfault),
a buffered file flushes the parent's data a second time. So, once :func:`install` ran (the loaders
call it on first use: when a producer thread starts, when a DataLoader starts its workers; never
at import), every ``os.fork`` freezes the collector's objects (``gc.freeze``) just before and
thaws them again in the parent only: the child keeps them out of its collector. A process that
froze objects itself is left as it is.
"""
from __future__ import annotations

import gc
import os

_state = {"installed": False, "froze": False}


def _before_fork() -> None:
    _state["froze"] = gc.get_freeze_count() == 0
    if _state["froze"]:
        gc.freeze()


def _after_fork_in_parent() -> None:
    if _state["froze"]:
        gc.unfreeze()
    _state["froze"] = False


def _after_fork_in_child() -> None:
    _state["froze"] = False  # the inherited objects stay frozen here


def install() -> None:
    """Register the fork hooks (once per process)."""
    if _state["installed"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
    _state["installed"] = True
