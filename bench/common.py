"""Shared bits of the benchmark scripts: the environment record, tables, writing results, batch feeds, and a
profiler timeline per CUDA stream.

The baselines (torch + PIL, webdataset, hand-written DALI, endless / replayed sources) live in
``datapipe.tools.bench.baselines``.

The environment record and the table format are the library's own (``datapipe.tools.bench.cli``), so the
scripts here and ``datapipe bench`` write results alike.
"""
from __future__ import annotations

import contextlib
import json
import os

from datapipe.tools.bench.baselines import endless, replay  # noqa: F401  (re-exported for the scripts)
from datapipe.tools.bench.cli import environment, table  # noqa: F401  (re-exported for the scripts)


def result_path(name: str, directory: str | None = None) -> str:
    """``bench/results/<name>.json``, or ``<directory>/<name>.json``."""
    return os.path.join(directory or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        f"{name}.json")


def read_result(name: str, directory: str | None = None) -> dict | None:
    """The result :func:`write_result` wrote there, or None if there is none."""
    path = result_path(name, directory)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_result(name: str, result: dict, directory: str | None = None) -> str:
    """Write ``bench/results/<name>.json`` (or under ``directory``) and return the path."""
    path = result_path(name, directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), **result}, f, indent=1, default=str)
        f.write("\n")
    return path


def to_device(batches, device):
    """``(images, labels)`` batches moved to ``device`` (labels made tensors first), copies non-blocking."""
    import torch

    for x, y in batches:
        yield x.to(device, non_blocking=True), torch.as_tensor(y).to(device, non_blocking=True)


def sync(device) -> None:
    """Wait for ``device``'s queued work (a ``torch.device`` or its name; nothing to wait for on CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def retiring(on: bool = True):
    """With ``on=False``, loaders made inside free the batches they handed out in the training thread
    (as before ``datapipe.device.handoff.Retirer``): the A/B switch of the benchmarks."""
    from datapipe.device import handoff

    handed = handoff.Retirer.handed
    if not on:
        handoff.Retirer.handed = lambda self, item: None
    try:
        yield
    finally:
        handoff.Retirer.handed = handed


class GpuSampler:
    """SM clock (MHz) and board power (W) of one GPU, sampled by ``nvidia-smi`` every 100 ms while open.

    ``stop()`` returns their means (``{}`` without nvidia-smi or a CUDA device): a loader that makes
    the GPU draw more power can slow training through the clock, not only through SM time.
    """

    def __init__(self, device):
        import shutil
        import subprocess

        self.proc = None
        if getattr(device, "type", None) == "cuda" and shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(device.index or 0), "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            return {}
        rows = []
        for line in out.splitlines():
            try:
                rows.append([float(x) for x in line.split(",")])
            except ValueError:
                continue
        if not rows:
            return {}
        n = len(rows)
        return {"sm_mhz": round(sum(r[0] for r in rows) / n), "power_w": round(sum(r[1] for r in rows) / n, 1)}


def ensure_tokens(directory: str, docs: int, rank: int = 0) -> list[str]:
    """Token shards of ``docs`` documents (log-normal lengths, int32 ``npy``) in ``directory``, made once."""
    import io

    import numpy as np

    from datapipe import ShardWriter
    from datapipe.tar.manifest import read_manifest

    if rank == 0 and (read_manifest(directory) or {}).get("num_samples") != docs:
        rng = np.random.default_rng(0)
        lengths = np.clip(rng.lognormal(6.5, 1.0, docs).astype(int), 1, 8192)
        with ShardWriter(os.path.join(directory, "tok-%05d.tar"), max_count=2000) as writer:
            for i, n in enumerate(lengths):
                buf = io.BytesIO()
                np.save(buf, rng.integers(0, 32000, n, dtype=np.int32))
                writer.write({"__key__": f"{i:08d}", "npy": buf.getvalue()})
    return [os.path.join(directory, s["name"]) for s in read_manifest(directory)["shards"]]


# ---- a profiler timeline, per CUDA stream (bench/ceiling.py --profile) -------------------------------------
def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time (same units) where the merged interval lists ``a`` and ``b`` both run."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, e - s)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's device work; "cuda_runtime" is the host's calls


def is_host_sync(event: dict) -> bool:
    """A host call that waits for the GPU (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ...)."""
    return event.get("cat") == "cuda_runtime" and "ynchronize" in event.get("name", "")


def analyse(events: list[dict], steps: int, train_stream) -> dict:
    """Per step: device ms per stream (top kernels), the loader's own work (other streams) and its overlap
    with the training stream's kernels; and the host's waits for the GPU (``cuda_runtime`` calls named
    ``...Synchronize``, from any thread: ``host_syncs_per_step`` and their ms)."""
    syncs = [e for e in events if is_host_sync(e)]
    events = [e for e in events if e.get("cat", "kernel") in DEVICE_EVENTS]
    streams: dict = {}
    for e in events:
        s = e.get("args", {}).get("stream")
        d = streams.setdefault(s, {"ms": 0.0, "n": 0, "names": {}})
        d["ms"] += e["dur"] / 1e3
        d["n"] += 1
        d["names"][e["name"]] = d["names"].get(e["name"], 0.0) + e["dur"] / 1e3
    train = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("args", {}).get("stream") == train_stream]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("args", {}).get("stream") != train_stream]
    train_busy, other_busy = _busy(train), _busy(other)
    out = {"streams": {str(s): {"ms_per_step": round(d["ms"] / steps, 3), "events_per_step": round(d["n"] / steps, 1),
                                "top": [(k[:70], round(v / steps, 3)) for k, v in
                                        sorted(d["names"].items(), key=lambda kv: -kv[1])[:6]]}
                       for s, d in streams.items()},
           "train_stream": str(train_stream),
           "train_kernel_ms_per_step": round(sum(e - s for s, e in train) / 1e3 / steps, 3),
           "loader_device_ms_per_step": round(sum(e - s for s, e in other) / 1e3 / steps, 3),
           "overlap_ms_per_step": round(_overlap(train_busy, other_busy) / 1e3 / steps, 3),
           "loader_copy_ms_per_step": round(sum(e["dur"] for e in events if e.get("cat") == "gpu_memcpy" and
                                                e.get("args", {}).get("stream") != train_stream) / 1e3 / steps, 3)}
    if events:
        span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        out["wall_ms_per_step"] = round(span / 1e3 / steps, 3)
    out["host_syncs_per_step"] = round(len(syncs) / steps, 2)
    out["host_sync_ms_per_step"] = round(sum(e["dur"] for e in syncs) / 1e3 / steps, 3)
    return out
