"""The peers benchmark's figures as a table: one row per measurement, one column per system, and the notes
printed under it (:mod:`datapipe.tools.bench.peers` measures them)."""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["SHORT_EPOCH_S", "how_lines", "run_notes", "short_decodes", "short_epochs", "summary", "table_rows"]

SHORT_EPOCH_S = 3.0  # epochs shorter than this are named in the notes (the run of record wants longer ones)


def _get(d: dict, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def summary(result: dict) -> list[dict]:
    """One row per measurement, one column per system: the figures the docs and the README quote."""
    systems = result["systems"]
    settings = result["settings"]
    rows: list[tuple[str, Callable[[dict], Any]]] = [("write, images/s", lambda e: _get(e, "write", "images_per_s"))]
    for w in settings["workers"]:
        for ep in (1, 2):
            rows.append((f"raw bytes, {w} workers, epoch {ep}, samples/s",
                         lambda e, w=w, ep=ep: _get(e, "raw", str(w), f"epoch{ep}", "samples_per_s")))
    w0 = min(settings["workers"]) if settings["workers"] else None
    if w0 is not None:
        rows.append((f"construct + first batch, {w0} workers (s)",
                     lambda e: _get(e, "raw", str(w0), "construct_first_batch_s")))
    rw, dw = settings.get("resume_workers"), settings["decode_workers"]
    rows += [
        (f"mid-epoch resume, {rw} workers, first batch after load (s)", lambda e: _get(e, "resume", "first_batch_s")),
        ("mid-epoch resume, exact rest", lambda e: _get(e, "resume", "exact")),
        ("mid-epoch resume, same continuation", lambda e: _get(e, "resume", "same_order")),
        (f"PIL decode + crop, {dw} workers, steady samples/s", lambda e: _get(e, "decode", "steady_samples_per_s")),
        ("same, first batch (s)", lambda e: _get(e, "decode", "first_batch_s")),
        (f"peak PSS with {dw} decode workers (MB)", lambda e: _get(e, "decode", "peak_pss_mb")),
        (f"own decoder + crop, {dw} threads, steady samples/s",
         lambda e: _get(e, "decode_own", "steady_samples_per_s")),
        ("own decoder, first batch (s)", lambda e: _get(e, "decode_own", "first_batch_s")),
    ]
    out = []
    for name, get in rows:
        row: dict[str, Any] = {"row": name}
        for system, entry in systems.items():
            row[system] = get(entry)
        out.append(row)
    return out


def run_notes(result: dict) -> list[str]:
    """Lines to print under the table: the run's notes, each system that was not measured and each row that
    failed, with why, and the epochs that were cut at ``epoch_cap_s``."""
    lines = [f"note: {n}" for n in result.get("notes", [])]
    for system, entry in result["systems"].items():
        if entry.get("error"):
            lines.append(f"{system}: not measured: {entry['error']}")
            continue
        named = [(k, entry.get(k)) for k in ("write", "resume", "decode", "decode_own")]
        named += [(f"raw bytes, {w} workers", r) for w, r in (entry.get("raw") or {}).items()]
        for name, r in named:
            if isinstance(r, dict) and r.get("error") and r["error"] != "no mid-epoch resume":
                lines.append(f"{system}: {name}: {r['error']}")
        capped = [f"{w} workers epoch {ep}" for w, r in (entry.get("raw") or {}).items() for ep in (1, 2)
                  if _get(r, f"epoch{ep}", "capped")]
        if capped:
            lines.append(f"{system}: cut at {result['settings'].get('epoch_cap_s')} s (rate over what was read): "
                         + ", ".join(capped))
    return lines


def how_lines(result: dict) -> list[str]:
    """What each system did: its format and writer, and its loader at each worker count."""
    lines = []
    for system, entry in result["systems"].items():
        how = entry.get("how") or {}
        if how:
            lines.append(f"{system}: " + "; ".join(f"{k}: {v}" for k, v in how.items()))
    return lines


def table_rows(result: dict) -> list[dict]:
    """:func:`summary` as strings, errors shown where a system has none of a row's figure."""
    out = []
    for row in result["table"]:
        cells = {"row": row["row"]}
        for system, entry in result["systems"].items():
            v = row.get(system)
            if v is None:
                cells[system] = "n/a" if entry.get("error") else "-"
            elif isinstance(v, bool):
                cells[system] = "yes" if v else "NO"
            elif isinstance(v, float):
                cells[system] = f"{v:,.2f}" if v < 100 else f"{v:,.0f}"
            else:
                cells[system] = str(v)
        out.append(cells)
    return out


def short_decodes(result: dict) -> list[str]:
    """The decode rows whose steady window ended before ``decode_seconds`` (the epoch ran out first): their rate
    is over that shorter window."""
    want = result["settings"].get("decode_seconds")
    out = []
    for system, entry in result["systems"].items():
        for key in ("decode", "decode_own"):
            took = _get(entry, key, "steady_seconds")
            if want and took is not None and took < 0.9 * want:
                out.append(f"{system} {key} ({took} s)")
    return out


def short_epochs(result: dict, shorter_than: float | None = None) -> list[str]:
    """The raw-bytes epochs read to their end in under ``shorter_than`` seconds (default :data:`SHORT_EPOCH_S`)."""
    shorter_than = SHORT_EPOCH_S if shorter_than is None else shorter_than
    out = []
    for system, entry in result["systems"].items():
        for w, row in (entry.get("raw") or {}).items():
            for ep in ("epoch1", "epoch2"):
                e = row.get(ep) or {}
                if e.get("seconds") is not None and e["seconds"] < shorter_than and not e.get("capped"):
                    out.append(f"{system} {w} workers {ep} ({e['seconds']} s)")
    return out
