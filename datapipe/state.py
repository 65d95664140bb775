"""The state contract every stateful stage follows (torchdata.nodes is the model).

A stage (``ShardStream``, ``mix``, ``Packer``, ``TokenLoader``, ``ImageLoader``,
``loaders.DataLoader``...) has ``state_dict()`` and ``load_state_dict(state)``:

- ``state_dict()`` returns the position after the last item handed out (read-ahead is not
  counted) as a nested dict of plain values (ints, strings, lists, dicts, numpy arrays), of the
  same shape at every step of an epoch, so a checkpoint written at step 3 and one written at
  step 300 differ only in their values.
- ``load_state_dict(state)`` makes the next iteration yield exactly what the saved run had not
  yet handed out. A state of another kind, or without the keys the stage needs, is a
  ``ValueError`` that says so (:func:`check_state`), never a silent fresh start.
- The keys a state carries:
  ``"kind"``: what it is (the stage's class name, e.g. ``"ImageLoader"``; states saved before
  the key existed lack it and are recognised by their keys); ``"epoch"``: the epoch it was taken
  in; the shape it was taken on: ``"rank"`` / ``"world_size"`` / ``"num_workers"`` in the state
  of the stage that splits the work (``ShardStream``), which is what
  :mod:`datapipe.order.elastic` reads to merge the states of all ranks into one global state.
- A composite stage embeds its source's own ``state_dict()`` unchanged under ``"source"`` or a
  named key (``"stream"``, ``"dataset"``, ``"loader"``, ``"batcher"``, ``"sources"``) and hands it
  back to the source's ``load_state_dict``; it never writes a state in its source's format itself.
  Its own counters sit beside it (``{"source": {...}, "batches": n}``).
- A state records what it was taken over (a stream's ``seed``, ``shuffle``, ``shuffle_buffer`` and
  ``shards``, the fingerprint of its shard list; a mix's ``weights``): ``load_state_dict`` refuses a
  state taken over anything else, naming each difference with both values (:func:`check_identity`).
  A malformed state (a key missing, a value of the wrong type) is a ValueError naming it.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

KIND = "kind"


@runtime_checkable
class Stateful(Protocol):
    """A stage whose position can be saved and resumed (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_state(state: Any, kind: str, *, keys: Sequence[str] | Mapping[str, type] = ()) -> Mapping[str, Any]:
    """``state`` if it is a state of ``kind`` holding ``keys``; else a ValueError that says what it is.

    ``keys``: names, or names with the type their values must have (``{"epoch": numbers.Integral}``).
    A state without a ``"kind"`` entry (saved before the key existed) passes when it holds ``keys``.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"not a {kind} state: expected the dict that {kind}.state_dict() returns, "
                         f"got {type(state).__name__}")
    found = state.get(KIND)
    if found is not None and found != kind:
        raise ValueError(f"this is a {found} state, not a {kind} state: load it into a {found}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"not a {kind} state: no {', '.join(repr(k) for k in missing)} "
                         f"entr{'y' if len(missing) == 1 else 'ies'}; pass what {kind}.state_dict() returned")
    if isinstance(keys, Mapping):
        for key, want in keys.items():
            value = state[key]
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                raise ValueError(f"not a {kind} state: its {key!r} entry is {type(value).__name__} {value!r:.60}, "
                                 f"expected {getattr(want, '__name__', want)}; pass what {kind}.state_dict() returned")
    return state


def check_identity(state: Mapping[str, Any], kind: str, current: Mapping[str, Any]) -> None:
    """A ValueError naming every setting ``state`` was taken with that differs from ``current``, with both values.

    Keys the state lacks are not compared (states saved before they were recorded).
    """
    diffs = [f"{key}={state[key]!r} (this {kind} has {key}={value!r})" for key, value in current.items()
             if key in state and state[key] != value]
    if diffs:
        raise ValueError(f"this checkpoint was taken over other data or settings: {'; '.join(diffs)}. "
                         f"Load it into a {kind} made with the same settings and shards")
