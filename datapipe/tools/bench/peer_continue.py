"""A peers run that goes on from an earlier one its budget cut short (``bench/peers.py --rest``): which rows that run
finished, and whether it was a run of the same settings."""
from __future__ import annotations

from typing import Any

BUDGET_CUT = ("not run: the run's budget", "stopped at the run's budget")
SAME_SETTINGS = ("batch_size", "workers", "decode_workers", "resume_workers", "image_size", "seed", "epoch_cap_s",
                 "decode_seconds")


def finished(row: Any) -> bool:
    """A row an earlier run finished (its figures, or a failure of its own), not one that run's budget cut."""
    return isinstance(row, dict) and not str(row.get("error", "")).startswith(BUDGET_CUT)


ROWS_KEPT = ("write", "raw", "resume", "decode", "decode_own")  # a system's rows an earlier run can hand on


def all_finished(entry: dict, workers, *, own_decoder: bool = False) -> bool:
    """Whether every row of a system's ``entry`` was run to its end (a failure of its own counts as run);
    ``own_decoder``: the system has a ``decode_own`` row too."""
    raw = entry.get("raw") or {}
    rows = ("write", "resume", "decode") + (("decode_own",) if own_decoder else ())
    return all(finished(entry.get(k)) for k in rows) and all(finished(raw.get(str(w))) for w in workers)


def earlier_systems(earlier: dict | None, settings: dict, images: int) -> dict:
    """The systems of ``earlier`` (a result whose budget cut it short), checked to be a run of these settings."""
    if not earlier:
        return {}
    theirs = earlier.get("settings", {})
    differ = [k for k in SAME_SETTINGS if theirs.get(k) != settings[k]]
    if differ or earlier.get("source", {}).get("images") != images:
        what = ", ".join(f"{k} {theirs.get(k)!r} -> {settings[k]!r}" for k in differ) or "another image count"
        raise ValueError(f"the earlier run was made with other settings ({what}): run it whole instead")
    return earlier.get("systems", {})
