"""A packed worker batch's body: the batch with a :class:`Slot` in place of each leaf that travels apart
(:mod:`loaders.dataloader.rawshm`), pickled when it holds plain values alone, and filled back with the leaves."""
from __future__ import annotations

import io
import pickle

from loaders.dataloader.shm import _LEAVES, map_leaves

__all__ = ["Slot", "batch_of", "filled", "plain_pickle"]


class Slot(int):
    """A packed leaf's place in the batch sent: its number in the :class:`Packed` tables."""

    __slots__ = ()


class _NotPlain(Exception):
    pass


class BodyPickler(pickle.Pickler):
    """Pickles a body of plain values, each :class:`Slot` as its persistent id; anything else raises
    :class:`_NotPlain` (``reducer_override`` sees every object but the built-in types)."""

    def persistent_id(self, obj):
        return int(obj) if type(obj) is Slot else None

    def reducer_override(self, obj):
        raise _NotPlain


def plain_pickle(body) -> bytes | None:
    """``body`` pickled by :class:`BodyPickler`, or None when it holds anything but plain values."""
    out = io.BytesIO()
    try:
        BodyPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(body)
    except _NotPlain:
        return None
    return out.getvalue()


def batch_of(body, out: list, pickled, view):
    """The batch: ``body`` with its slots filled from ``out``, or ``pickled`` loaded with them."""
    if pickled is None:
        return filled(body, out)
    if type(pickled) is tuple:
        offset, n = pickled
        pickled = view[offset:offset + n]
    loader = pickle.Unpickler(io.BytesIO(pickled))
    loader.persistent_load = out.__getitem__
    return loader.load()


def filled(x, out: list):
    """``x`` with ``out[slot]`` in place of each slot. The dicts and lists holding slots are the batch's own
    (rebuilt by :func:`pack_raw`, then by unpickling): they change in place; other containers are rebuilt."""
    kind = type(x)
    if kind is Slot:
        return out[x]
    if kind is dict:
        for k, v in x.items():
            if type(v) not in _LEAVES:
                x[k] = filled(v, out)  # the same keys: the dict's size never changes
        return x
    if kind is list:
        for i, v in enumerate(x):
            if type(v) not in _LEAVES:
                x[i] = filled(v, out)
        return x
    return map_leaves(x, lambda y: out[y] if type(y) is Slot else y)
