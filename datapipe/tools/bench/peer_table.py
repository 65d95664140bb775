"""The peers benchmark's figures as a table: one row per measurement, one column per system, and the notes
printed under it (:mod:`datapipe.tools.bench.peers` measures them)."""
from __future__ import annotations

__all__ = ["run_notes", "summary", "table_rows"]


def _get(d: dict, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def summary(result: dict) -> list[dict]:
    """One row per measurement, one column per system: the figures the docs and the README quote."""
    systems = result["systems"]
    rows: list[tuple[str, Callable[[dict], Any]]] = [("write, images/s", lambda e: _get(e, "write", "images_per_s"))]
    for w in result["settings"]["workers"]:
        for ep in (1, 2):
            rows.append((f"raw bytes, {w} workers, epoch {ep}, samples/s",
                         lambda e, w=w, ep=ep: _get(e, "raw", str(w), f"epoch{ep}", "samples_per_s")))
    dw = result["settings"]["decode_workers"]
    rows += [
        (f"PIL decode + crop, {dw} workers, steady samples/s", lambda e: _get(e, "decode", "steady_samples_per_s")),
        ("same, first batch (s)", lambda e: _get(e, "decode", "first_batch_s")),
        ("mid-epoch resume, first batch after load (s)", lambda e: _get(e, "resume", "first_batch_s")),
        ("mid-epoch resume, exact rest", lambda e: _get(e, "resume", "exact")),
        (f"peak PSS with {dw} decode workers (MB)", lambda e: _get(e, "decode", "peak_pss_mb")),
    ]
    out = []
    for name, get in rows:
        row: dict[str, Any] = {"row": name}
        for system, entry in systems.items():
            row[system] = get(entry)
        out.append(row)
    return out


def run_notes(result: dict) -> list[str]:
    """Lines to print under the table: the run's notes, and each system that was not measured, with why."""
    lines = [f"note: {n}" for n in result.get("notes", [])]
    lines += [f"{system}: not measured: {entry['error']}" for system, entry in result["systems"].items()
              if entry.get("error")]
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
