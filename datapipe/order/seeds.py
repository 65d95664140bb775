"""The one seed rule: every stream of randomness derives from (seed, epoch, rank, worker, purpose).

``derive_seed(seed, epoch, *parts)`` hashes its arguments' ``repr`` through ``random.Random``
(SHA-512 of the text), so the same arguments give the same seed in every process, on every
platform and Python version. ``parts`` are ints (rank, worker, ...) and at most one purpose name
(a string such as ``"dali"``), so two consumers of the same (seed, epoch, rank) never share a stream.
"""
from __future__ import annotations

import random


def derive_seed(seed: int, epoch: int = 0, *parts: int | str, bits: int = 63) -> int:
    """A stable ``bits``-bit seed from ``seed``, ``epoch`` and further parts (rank, worker, purpose)."""
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in 1..63, got {bits}")
    key = (int(seed), int(epoch)) + tuple(p if isinstance(p, str) else int(p) for p in parts)
    return random.Random(repr(key)).getrandbits(63) >> (63 - bits)
