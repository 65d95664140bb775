"""``datapipe bench storage|loader``: storage and input-pipeline throughput, as a table, JSON and a PNG plot.

    datapipe bench storage URL... [--concurrency 1,2,4,8] [--block-size 1M,4M,16M] [--seconds N]
                                  [--processes] [--json FILE] [--plot FILE.png]
    datapipe bench loader DATA [--pipelines torch,webdataset,dali,datapipe-images,datapipe-loader,
                                datapipe-tokens,naive-pad] [--batch-size B] [--workers W]
                               [--device cpu|cuda] [--steps N] [--make-images N] [--json FILE]

The measurements live in :mod:`datapipe.tools.bench.storage` (``run_storage``) and
:mod:`datapipe.tools.bench.loader` (``run_loader``); this module holds what they share (environment record,
tables, JSON) and the storage command. The command line is :mod:`datapipe.tools.bench.loader_cli`.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

from datapipe.device.autotune import usable_cores
from datapipe.units import parse_size
from datapipe.errors import DataError
from datapipe.storage.urls import redact_text


def environment() -> dict[str, Any]:
    """GPU name (or "cpu"), CPU counts, library versions and the date, recorded with every result."""
    gpu = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except ImportError:
        pass
    versions = {}
    for name in ("datapipe", "torch", "numpy", "webdataset", "fsspec", "s3fs", "nvidia-dali-cuda130", "pillow", "litdata",
                 "mosaicml-streaming"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    cores = usable_cores()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu, "cpu_count": os.cpu_count(), "usable_cores": cores,
        "cpu": platform.processor() or platform.machine(), "python": sys.version.split()[0], "versions": versions,
        "machine": f"{cores} CPU cores, " + ("no GPU" if gpu == "cpu" else f"GPU {gpu}"),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table (columns without any value are left out)."""
    columns = [c for c in columns if any(str(r.get(c, "")) != "" for r in rows)]
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(vals):
        return "  ".join(v.rjust(w) for v, w in zip(vals, widths))

    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(row) for row in cells])


def write_json(path: str, result: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), **result}, f, indent=1, default=str)
        f.write("\n")
    return path


def plot_path(args) -> str | None:
    """``--plot``, else the JSON path with ``.png`` (unless ``--no-plot``)."""
    if getattr(args, "no_plot", False):
        return None
    if args.plot:
        return args.plot
    return os.path.splitext(args.json)[0] + ".png" if args.json else None


# ---- storage --------------------------------------------------------------------------------------
def run_storage(*a, **kw):
    """See :func:`datapipe.tools.bench.storage.run_storage`."""
    from datapipe.tools.bench.storage import run_storage as run

    return run(*a, **kw)


def _storage_command(args) -> int:
    from datapipe.tools.bench import storage as bs
    from datapipe.tools.bench.storage_report import TABLE_COLUMNS, rows_for_table

    try:
        options = json.loads(args.storage_options) if args.storage_options else None
        result = bs.run_storage(args.urls, concurrency=bs.parse_list(args.concurrency),
                                block_sizes=bs.parse_list(args.block_size, parse_size), seconds=args.seconds,
                                processes=args.processes, storage_options=options, progress=not args.no_progress)
    except (DataError, OSError, ValueError) as e:
        print(f"datapipe bench storage: {redact_text(e)}", file=sys.stderr)
        return 1
    print(table(rows_for_table(result), TABLE_COLUMNS))
    print(f"page cache: {result['page_cache']['reason']}")
    print(f"recommendation: {result['recommendation']['text']}")
    if result["recommendation"].get("warning"):
        print(f"warning: {result['recommendation']['warning']}")
    _outputs(args, result, "storage")
    return 0


def _outputs(args, result: dict, kind: str) -> None:
    if args.json:
        print(f"wrote {write_json(args.json, result)}", file=sys.stderr)
    png = plot_path(args)
    if png:
        from datapipe.tools import plots

        if plots.missing():
            print(f"no plot: {plots.missing()}", file=sys.stderr)
            return
        getattr(plots, f"plot_{kind}")(result, png)
        print(f"wrote {png}", file=sys.stderr)


__all__ = ["run_storage", "environment", "table", "write_json"]
