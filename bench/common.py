"""Shared bits of the benchmarks: the environment record and writing results."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib import metadata


def environment() -> dict:
    """GPU name, CPU count, library versions and date, recorded with every result."""
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
        torch_version = torch.__version__
    except ImportError:
        gpu, torch_version = "none", None
    versions = {}
    for name in ("datapipe", "torch", "numpy", "webdataset", "fsspec", "nvidia-dali-cuda130", "torchvision", "pillow"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    versions["torch"] = torch_version
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def write_result(name: str, result: dict, directory: str | None = None) -> str:
    """Write ``bench/results/<name>.json`` (or under ``directory``) and return the path."""
    directory = directory or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(), **result}, f, indent=1)
        f.write("\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table for the end of a benchmark's output."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(row) for row in cells])
