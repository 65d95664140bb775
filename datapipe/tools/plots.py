"""PNG plots of benchmark and doctor results (matplotlib with the Agg backend, imported only when called)."""
from __future__ import annotations

import os

from datapipe.units import format_size


def missing() -> str | None:
    """Why no plot can be drawn here (matplotlib not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install matplotlib; --no-plot skips the PNG)"
    return None


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _storage_axes(ax, result: dict, title: str) -> None:
    modes = sorted({r["mode"] for r in result["sweep"]})
    for mode in modes:
        for block in sorted({r["block_size"] for r in result["sweep"]}):
            rows = sorted((r for r in result["sweep"] if r["mode"] == mode and r["block_size"] == block),
                          key=lambda r: r["concurrency"])
            if rows:
                ax.plot([r["concurrency"] for r in rows], [r["mb_per_s"] for r in rows], marker="o",
                        linestyle="-" if mode == "threads" else "--", label=f"{format_size(block)} blocks ({mode})")
    styles = iter([":", "-."] * 4)
    for state, r in result.get("sequential", {}).items():
        ax.axhline(r["mb_per_s"], color="gray", linestyle=next(styles), label=f"sequential read ({state})")
    for name, r in result.get("stream", {}).items():
        ax.axhline(r["mb_per_s"], color="tab:red", linestyle=next(styles), alpha=0.7,
                   label=f"ShardStream ({name}, {r.get('cache', '')})")
    state = result["sweep"][0]["cache"] if result["sweep"] else ""
    ax.set_xscale("log", base=2)
    ticks = sorted({r["concurrency"] for r in result["sweep"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("MB/s")
    ax.set_title(f"{title} (sweep: {state})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_storage(result: dict, path: str) -> str:
    """Throughput vs concurrency, one line per block size; sequential and ShardStream as reference lines."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _storage_axes(ax, result, f"storage: {result.get('storage', '')}")
    return _save(fig, path)


def plot_storages(results: dict[str, dict], path: str) -> str:
    """Several storages side by side (one panel each)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        _storage_axes(ax, result, name)
    return _save(fig, path)


def plot_loader(result: dict, path: str) -> str:
    """Samples/s per pipeline (left) and per stage with the bottleneck marked (right)."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    ok = [p for p in result["pipelines"] if not p.get("error") and p.get("samples_per_s")]
    a.barh([p["name"] for p in ok], [p["samples_per_s"] for p in ok], color="tab:blue")
    for i, p in enumerate(ok):
        a.text(p["samples_per_s"], i, f" {p['samples_per_s']:.0f}", va="center", fontsize=8)
    a.set_xlabel("samples/s")
    a.set_title(f"pipelines ({result.get('kind', '')}, {result.get('device', '')})")
    a.invert_yaxis()
    stages = [s for s in result["stages"] if s.get("samples_per_s")]
    worst = result.get("bottleneck", {}).get("stage")
    b.barh([s["stage"] for s in stages], [s["samples_per_s"] for s in stages],
           color=["tab:red" if s["stage"] == worst else "tab:gray" for s in stages])
    for i, s in enumerate(stages):
        b.text(s["samples_per_s"], i, f" {s['samples_per_s']:.0f}", va="center", fontsize=8)
    b.set_xscale("log")
    b.set_xlabel("samples/s (log)")
    b.set_title(f"stages (bottleneck: {worst})")
    b.invert_yaxis()
    return _save(fig, path)


def plot_doctor(report: dict, path: str) -> str:
    """Data-wait fraction over time (per window of steps) and the step-time breakdown."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    tl = report.get("timeline", {})
    t, wait = tl.get("t_s", []), tl.get("wait_fraction", [])
    a.plot(t, [w * 100 for w in wait], color="tab:red")
    a.fill_between(t, [w * 100 for w in wait], color="tab:red", alpha=0.2)
    a.set_ylim(0, 100)
    a.set_xlabel("time (s)")
    a.set_ylabel("waiting for data (% of step)")
    a.set_title(f"data wait over time (overall {report['wait_fraction']:.0%})")
    a.grid(alpha=0.3)
    parts = [("wait", report["wait_fraction"], "tab:red"), ("compute", report["compute_fraction"], "tab:green"),
             ("other", report["other_fraction"], "tab:gray")]
    bottom = 0.0
    for name, frac, color in parts:
        b.bar([0], [frac * 100], bottom=[bottom], color=color, label=f"{name} {frac:.0%}")
        bottom += frac * 100
    b.set_xticks([])
    b.set_ylim(0, 100)
    b.set_title("step time")
    b.legend(fontsize=8)
    return _save(fig, path)


def plot_worker_shm(result: dict, path: str) -> str:
    """``bench/worker_shm.py``: batches per second of each variant, one panel per case (the workers' CPU
    work per batch), each bar labelled with its ratio to torch's loader."""
    plt = _plt()
    cases = sorted({r["spin_ms"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 3.8), squeeze=False)
    for ax, spin in zip(axes[0], cases):
        rows = [r for r in result["rows"] if r["spin_ms"] == spin]
        ax.barh([r["variant"] for r in rows], [r["batches_per_s"] for r in rows],
                color=["tab:blue" if r["variant"].startswith("dl_ours") or r["variant"] == "recycled" else "tab:gray"
                       for r in rows])
        for i, r in enumerate(rows):
            ax.text(r["batches_per_s"], i, f" {r['batches_per_s']:.0f} ({r['vs_torch']:.2f}x)", va="center",
                    fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("batches/s")
        ax.set_title(f"{spin:g} ms of CPU work per batch in a worker")
        ax.margins(x=0.25)
    fig.suptitle(f"worker-bound loading, {result.get('gpu') or 'CPU'} (ratios to the row torch)", fontsize=10)
    return _save(fig, path)


def plot_peers(result: dict, path: str) -> str:
    """One panel per numeric row of the peers table, a bar per system (missing figures left out)."""
    plt = _plt()
    rows = [r for r in result["table"] if any(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for k, v in r.items() if k != "row")]
    systems = list(result["systems"])
    cols = 3
    nrows = max(1, -(-len(rows) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 2.8 * nrows), squeeze=False)
    colors = {"torch": "tab:gray", "webdataset": "tab:olive", "datapipe": "tab:blue", "litdata": "tab:purple",
              "mosaicml": "tab:orange"}
    for ax, row in zip(axes.flat, rows):
        vals = [(s, row.get(s)) for s in systems]
        vals = [(s, v) for s, v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        ax.barh([s for s, _ in vals], [v for _, v in vals], color=[colors.get(s, "tab:green") for s, _ in vals])
        for i, (_, v) in enumerate(vals):
            ax.text(v, i, f" {v:,.2f}" if v < 100 else f" {v:,.0f}", va="center", fontsize=7)
        ax.set_title(row["row"], fontsize=8)
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    src = result.get("source", {})
    fig.suptitle(f"peers: {src.get('images', '?')} images of {src.get('mean_kb', '?')} KB, "
                 f"batch {result['settings']['batch_size']}", fontsize=10)
    return _save(fig, path)
