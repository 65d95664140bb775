"""More hardware work queues for this process's CUDA streams (``CUDA_DEVICE_MAX_CONNECTIONS``).

The driver feeds the GPU through a fixed number of hardware queues per context, 8 by default,
and maps the process's streams onto them in turn: two streams on one queue are ordered as if
they were one, so a training kernel can wait behind a loader's kernel or copy it does not depend
on. A DALI pipeline runs work on many streams of its own. With 32 queues (the most the driver
allows) ImageLoader's ResNet-50 step ran at 0.975-0.979 of its ceiling (eight rows) against
0.971-0.975 with the default (eight rows), one process each, interleaved, on an H200; the loader's
threads used 2.7-3.0 cores instead of 3.3 (``bench/results/ceiling_hw_queues.json``).

The driver reads the variable when it creates the context, so it only counts if set before
CUDA starts in this process: importing ``loaders.images`` sets it then, unless it is set
already (set ``CUDA_DEVICE_MAX_CONNECTIONS`` yourself to keep any other value, e.g. 8 or 1).
"""
from __future__ import annotations

import os

__all__ = ["HW_QUEUES", "VARIABLE", "widen_hardware_queues"]

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
HW_QUEUES = 32


def widen_hardware_queues(environ=os.environ) -> bool:
    """Ask for ``HW_QUEUES`` hardware queues; True if set now, False if the variable was already
    set (the user's choice stands) or CUDA has started here (too late to count)."""
    if VARIABLE in environ:
        return False
    import torch

    if torch.cuda.is_initialized():
        return False
    environ[VARIABLE] = str(HW_QUEUES)
    return True
