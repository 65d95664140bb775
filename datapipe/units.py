"""Sizes and percentiles, written once for the engine, the jobs and the tools.

``parse_size("512M")`` -> 536870912 and ``format_size(536870912)`` -> ``"512M"`` (binary units);
``percentiles(values)`` -> ``{"p50", "p90", "p99"}`` by linear interpolation between closest ranks
(numpy's default method), optionally scaled (seconds -> ms), rounded, and with the mean.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["format_size", "parse_size", "percentiles"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, *, minimum: int = 1) -> int:
    """``"4M"`` -> 4194304: bytes, or K/M/G/T (binary; ``KB``, ``KiB``, ``kib`` alike), fractions allowed.

    Raises ``ValueError`` naming ``text`` for anything else or a size below ``minimum`` bytes.
    """
    if not isinstance(text, str):
        raise TypeError(f"size {text!r}: pass a string such as '512M'")
    t = text.strip().upper()
    t = t.removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    num = t[: len(t) - len(unit)].strip()
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"bad size {text!r}: use bytes or K/M/G/T, e.g. 1000000, 512K, 4M, 1G") from None
    size = int(value * _UNITS[unit])
    if size < minimum:
        raise ValueError(f"size {text!r} must be at least {minimum} byte{'s' if minimum != 1 else ''}")
    return size


def format_size(n: int) -> str:
    """``4194304`` -> ``"4M"``: the largest binary unit that divides ``n`` exactly, else plain bytes."""
    for unit, div in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _quantile(ordered: Sequence[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentiles(values: Iterable[float], *, qs: Sequence[int] = (50, 90, 99), scale: float = 1.0,
                digits: int | None = None, mean: bool = False) -> dict:
    """``{"p50": .., "p90": .., "p99": ..}`` of ``values`` times ``scale`` (``None`` each when empty).

    With ``mean=True`` a ``"mean"`` entry comes first; ``digits`` rounds every entry.
    """
    ordered = sorted(float(v) * scale for v in values)
    keys = (["mean"] if mean else []) + [f"p{q:g}" for q in qs]
    if not ordered:
        return dict.fromkeys(keys)
    out = {"mean": sum(ordered) / len(ordered)} if mean else {}
    out.update({f"p{q:g}": _quantile(ordered, q / 100) for q in qs})
    if digits is not None:
        out = {k: round(v, digits) for k, v in out.items()}
    return out
