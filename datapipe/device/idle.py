"""How long a consumer's GPU sat idle while its host thread waited for a batch."""
from __future__ import annotations

import torch

from datapipe.device.handoff import CurrentStream


class IdleTimer:
    """The part of a wait in ``next()`` during which the consumer's current CUDA stream had nothing to run.

    :meth:`start`, as the wait begins, records a timing event on the stream: the GPU reaches it once it has
    run every step queued before. :meth:`idle_s`, as the batch arrives: 0 while the stream still has work (a
    loop that runs ahead of the GPU); else a second event, recorded on the idle stream, is reached at once, and
    the GPU time between the two is how long it had nothing to run. Under CUDA graphs the host asks for the
    next batch right after launching a ~40 ms step: it waits most of that step while the GPU still works, and
    only the end of the wait, after the step finished, leaves the GPU idle.
    """

    def __init__(self, device: torch.device):
        self.stream = CurrentStream(device)
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._started = False

    def start(self) -> None:
        """The consumer starts waiting (call before taking the batch)."""
        self._begin.record(self.stream())
        self._started = True

    def idle_s(self, waited: float) -> float:
        """The GPU's idle time during the wait that began at :meth:`start` and lasted ``waited`` seconds."""
        if not self._started:
            return waited
        self._started = False
        if not self._begin.query():
            return 0.0  # the stream still runs the steps queued before: the wait cost the GPU nothing
        self._end.record(self.stream())
        self._end.synchronize()  # at once: the stream is idle
        return max(0.0, min(waited, self._begin.elapsed_time(self._end) / 1e3))
