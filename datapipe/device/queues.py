"""CUDA's hardware queues for this process, and holding the host to the GPU when they are few.

The driver maps a process's streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (8 unless set,
at most 32), read once when CUDA starts. DALI decodes on ~24 streams: with 8 queues the hardware JPEG
decoder's work stalls behind the rest, and in a loop whose host runs ahead of the GPU (the training
queue never drains) the next batch is late; with 32 it does not. Measured on an H200 (ResNet-50,
8 queues, a loop that waits for the GPU every 50 steps), the hardware decoder: ImageLoader 0.92-0.93 of
the data-free ceiling left alone, 0.96 when its ``next()`` first waits for the GPU to finish the step
before (:class:`StepHold`). ImageLoader's default decodes on nvJPEG's CUDA decoder there instead (0.98,
no hold; :mod:`loaders.images.decoder_choice`), so the hold serves a hardware share the user chose, or
a process with too few cores for the CUDA decoder.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the hold runs: the constants serve modules that keep torch out
    import torch

__all__ = ["DEFAULT_QUEUES", "WIDE_QUEUES", "StepHold", "hardware_queues", "watch_cuda_start"]

DEFAULT_QUEUES = 8  # the driver's default
WIDE_QUEUES = 32  # the most the driver gives, and what DALI beside training needs


VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
_AT_CUDA_START: dict = {}  # "value": the variable as it was when CUDA started here, once known


def watch_cuda_start() -> None:
    """Note ``CUDA_DEVICE_MAX_CONNECTIONS`` when CUDA starts in this process, the moment CUDA reads it (at once
    if it has already started: a value changed before then is not seen). Safe to call more than once."""
    import torch

    if _AT_CUDA_START.get("watching"):
        return
    _AT_CUDA_START["watching"] = True
    lazy = getattr(torch.cuda, "_lazy_call", None)  # runs a callable right after CUDA starts (now if it has)
    if lazy is not None:
        lazy(lambda: _AT_CUDA_START.setdefault("value", os.environ.get(VARIABLE)))


def hardware_queues() -> int:
    """The hardware queues CUDA gives this process: ``CUDA_DEVICE_MAX_CONNECTIONS`` as it was when CUDA
    started (once :func:`watch_cuda_start` saw it start; before that, as it is now), else the driver's 8.
    A value set after CUDA started changes nothing, here as in CUDA."""
    value = _AT_CUDA_START["value"] if "value" in _AT_CUDA_START else os.environ.get(VARIABLE)
    value = (value or "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_QUEUES


class StepHold:
    """Makes ``next()`` wait until the consumer's stream finished its last step, when queues are few.

    ``active``: DALI decodes on the GPU (``decodes_on_gpu``) and CUDA has fewer than :data:`WIDE_QUEUES`
    hardware queues (ImageLoader calls it only while the hardware decoder is in use). Then every call waits
    for the consumer's current stream (the step launched before this ``next()``); in a loop that
    already waits for the GPU each step this returns at once. ``slack``: steps left queued (0: none; 1: the
    call waits for the step before the last, so the GPU runs the last one while the host launches the next;
    a probe's setting, unmeasured). ``seconds``: the time spent waiting.
    """

    def __init__(self, device: torch.device, *, decodes_on_gpu: bool = True, slack: int = 0):
        self.device = device
        self.active = decodes_on_gpu and device.type == "cuda" and hardware_queues() < WIDE_QUEUES
        self.slack = slack
        self.seconds = 0.0
        self._ends: list = []  # (slack) an event at the end of each step launched, the oldest first

    def __call__(self) -> None:
        if self.active:
            import torch

            t0 = time.perf_counter()
            stream = torch.cuda.current_stream(self.device)
            if self.slack <= 0:
                stream.synchronize()
            else:
                self._ends.append(stream.record_event())
                if len(self._ends) > self.slack:
                    self._ends.pop(0).synchronize()
            self.seconds += time.perf_counter() - t0
