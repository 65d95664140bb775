"""What a loader reads: its ``source`` (URLs, a folder or a :class:`datapipe.ShardStream`) as one stream.

A loader composes its source: a ``ShardStream`` is used as it is (it alone holds the shuffle, seed,
rank, ``on_error``, storage and cache settings); URLs get a stream with the loader's defaults.
"""
from __future__ import annotations

import os
from numbers import Integral

from datapipe.stream import ShardStream


def as_stream(source, *, shuffle: bool, shuffle_buffer: int) -> ShardStream:
    """``source`` as a ShardStream: the stream itself, or ``ShardStream(source, shuffle=shuffle,
    shuffle_buffer=shuffle_buffer if shuffle else 0, seed=0)`` for a URL pattern, a list of URLs or a folder."""
    if isinstance(source, ShardStream):
        return source
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, (list, tuple)):
        source = [os.fspath(u) if isinstance(u, os.PathLike) else u for u in source]
    elif not isinstance(source, str):
        raise TypeError(f"source: pass a URL pattern, a list of URLs, a folder or a datapipe.ShardStream, "
                        f"got {type(source).__name__}")
    return ShardStream(source, shuffle=shuffle, shuffle_buffer=shuffle_buffer if shuffle else 0, seed=0)


def stream_steps(stream: ShardStream) -> tuple:
    """The per-sample steps (``.decode()`` / ``.map()``) a stream applies, if any."""
    for name in ("steps", "_steps"):
        steps = getattr(stream, name, None)
        if steps:
            return tuple(steps)
    return ()


def check_positive_int(name: str, value) -> int:
    """``value`` as an int >= 1, or a TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name}={value!r}: pass an int >= 1, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}={value!r}: pass an int >= 1")
    return int(value)


def option_group(value, cls, name: str):
    """An option group argument: ``cls()`` for None, else ``value`` if it is a ``cls``."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name}= takes a {cls.__name__}(...), got {type(value).__name__}")
    return value


def stream_start(state: dict, epoch: int) -> dict:
    """A ShardStream ``state_dict()`` moved to the start of ``epoch``: same shape and shards, nothing read yet."""
    return {**state, "epoch": int(epoch), "workers": {}, "first_worker": 0, "generation": 0,
            "base": None}
