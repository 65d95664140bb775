"""The state at a sample a stage downstream of a :class:`datapipe.stream.ShardStream` holds: a cheap marker taken
after each sample (:meth:`SampleMarks.mark`), turned into a state only where one is needed
(:meth:`SampleMarks.state_before`, :meth:`SampleMarks.state_after`): ImageLoader's read workers keep one per
sample of a batch not yet sent."""
from __future__ import annotations

from typing import Any

__all__ = ["SampleMarks"]


class SampleMarks:
    """(Mixin of ``ShardStream``) marks of the samples of the pass under way, and the states at them; uses the
    stream's ``_position`` (this process's worker's position in that pass), ``_positions`` and ``state_dict``."""

    def mark(self) -> tuple:
        """A cheap marker of the sample this pass handed out last, to take right after each sample comes out.

        A stage that must be able to resume at any of the samples it holds (a batch not yet sent) keeps a
        mark per sample (a tuple, well under a microsecond) and turns only the marks it needs into
        states with :meth:`state_before` / :meth:`state_after` (as costly as :meth:`state_dict`). A mark
        holds for the pass it was taken in, in the process that iterates this stream (a DataLoader
        worker's copy: its own).
        """
        position = self._position
        if position is None:
            raise ValueError("mark() is taken during iteration: call it after a sample of a pass over this stream")
        return position, position["draws"], position.get("last"), position.get("owed")

    def state_before(self, mark: tuple) -> dict[str, Any]:
        """The state as it stood just before the sample of ``mark`` (:meth:`mark`) was drawn: loaded into a
        fresh stream, it yields exactly that sample and the rest of the epoch.

        (A repeat owed for losses at the very start of a worker's pass is handed out right after the sample
        it repeats, without a draw of its own: its state here is the one before that sample's draw, with
        the repeats still owed after it; it yields the same.)
        """
        position, draws, last, owed = mark
        if last is not None and last < draws:  # a repeat in the place of the lost item of this draw
            return self._state_at(position, draws - 1, last=last)
        return self._state_at(position, draws - 1, owed=owed)  # this draw's sample (or one owed repeat of it)

    def state_after(self, mark: tuple) -> dict[str, Any]:
        """The state right after the sample of ``mark`` was handed out (what :meth:`state_dict` returned then)."""
        position, draws, last, owed = mark
        return self._state_at(position, draws, last=last, owed=owed)

    def _state_at(self, position: dict, draws: int, **padding: int | None) -> dict[str, Any]:
        """:meth:`state_dict` with this worker's position at ``draws`` with the ``padding`` entries given."""
        if position is not self._position or draws < 0:
            raise ValueError("this mark was not taken after a sample of this stream's pass under way (marks "
                             "hold for the pass they were taken in): take one with mark() after each sample")
        state = self.state_dict()
        (worker,) = (w for w, p in self._positions.items() if p is position)
        at = {"draws": draws, "done": False, **{k: v for k, v in padding.items() if v is not None}}
        state["workers"] = {**state["workers"], worker: at}
        return state
