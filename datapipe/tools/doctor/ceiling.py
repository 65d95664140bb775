"""The doctor's data-free ceiling: after ``ceiling_after`` batches the last one is replayed through the user's
step ``ceiling_steps`` times, timed, and the loaded step rate after it is compared with that replayed rate.

A mixin of :class:`datapipe.tools.doctor.report.Doctor` (it reads and sets the doctor's attributes).
"""
from __future__ import annotations

import time
from typing import Any

from datapipe.tools.doctor.advice import _torch
from datapipe.words import counted, plural

__all__ = ["CeilingReplay", "ceiling_meaning"]


class CeilingReplay:
    """The replay of one cached batch through the step and its report, for :class:`Doctor`."""

    def _replayed(self):
        """The next replayed batch, or None once ``ceiling_steps`` replayed steps ran (then timed)."""
        now = time.perf_counter()
        if self._replay_t0 is None:  # the loader's step before ends here
            self._end_step(now)
            if self._sync():
                _torch().cuda.synchronize()
            self._replay_t0 = time.perf_counter()
        self._replay_left -= 1
        if self._replay_left > 0:
            self._replayed_batches += 1
            return self._replay
        if self._sync():
            _torch().cuda.synchronize()
        end = time.perf_counter()
        seconds = end - self._replay_t0
        self._replay_s += end - self._replay_t0
        self._replay_end = end
        self._ceiling = {"steps": self.ceiling_steps, "seconds": round(seconds, 4),
                         "batches_per_s": round(self.ceiling_steps / seconds, 3) if seconds > 0 else None}
        self._replay = None
        self._replay_end_step = len(self._steps)
        self._last_end = end
        return None

    def _ceiling_report(self) -> dict:
        """The data-free rate (the last batch replayed through the step) vs the loaded rate after it, and what
        the replay did to the user's run."""
        out: dict[str, Any] = {"ceiling_batches_per_s": None, "ceiling_ratio": None}
        if self.ceiling_steps:
            n, bs = self._replayed_batches, self._batch["batch_size"]
            samples = f" ({n * bs} samples counted twice by the script)" if bs and n else ""
            out["ceiling_replay"] = (
                f"batch {self.ceiling_after} was handed to the training loop {n} more times: {n} extra training "
                f"steps (optimizer steps, step counters, schedules) on a repeated batch{samples}; the doctor's "
                "step counts and times leave them out")
            out["ceiling_replayed_batches"] = n
        if self._ceiling is None:
            why = "not requested (ceiling_steps > 0)" if not self.ceiling_steps else (
                f"not measured: the run ended before {counted(self.ceiling_after, 'batch', 'batches')} + "
                f"{self.ceiling_steps} replayed {plural(self.ceiling_steps, 'step')}")
            return {**out, "ceiling": why}
        after = self._steps[self._replay_end_step:]
        out.update(ceiling_batches_per_s=self._ceiling["batches_per_s"], ceiling_steps=self.ceiling_steps)
        if len(after) < 3 or not out["ceiling_batches_per_s"]:
            return {**out, "ceiling": "not measured: fewer than 3 loader steps after the replay"}
        wall = after[-1][0] - self._replay_end
        loaded = len(after) / wall if wall > 0 else None
        ratio = round(loaded / out["ceiling_batches_per_s"], 4) if loaded else None
        return {**out, "loaded_batches_per_s": round(loaded, 3) if loaded else None, "ceiling_ratio": ratio,
                "ceiling_meaning": ceiling_meaning(ratio),
                "ceiling": f"{counted(self.ceiling_steps, 'step')} replaying one cached batch after "
                            f"{counted(self.ceiling_after, 'batch', 'batches')}"}


def ceiling_meaning(ratio: float | None) -> str:
    """What a loaded / data-free step-rate ratio says, in words (a ratio above 1 is no speed-up)."""
    if ratio is None:
        return "not measured"
    if ratio >= 1:
        return ("the loaded steps ran no slower than the replayed ones: no cost of the loader is measurable "
                "(a ratio above 1 is noise or the replay's own warm-up, not a speed-up)")
    return f"the loaded steps ran {1 - ratio:.1%} slower than the same step fed one cached batch"
