"""bench/ceiling.py's record: the summary of its rows, what a row says of ImageLoader's decoder, and adding a
run's rows to the ceiling.json already there (``--append``)."""
from __future__ import annotations

import statistics


def decoder_choice(loader) -> dict:
    """An ImageLoader's decoder as the row ended: its hardware decoder share, DALI threads, whether it moved
    by itself, whether ``next()`` held for the GPU (``{}`` for other loaders)."""
    s = loader.stats() if callable(getattr(loader, "stats", None)) else {}
    if not isinstance(s, dict) or "decoder" not in s:
        return {}
    return {"decoder": dict(s["decoder"]), "step_hold": s["step_hold"]["active"]}


def summary(rows: list[dict]) -> list[dict]:
    """Per config (step, compile mode, arch), loader, loop style and ``CUDA_DEVICE_MAX_CONNECTIONS``: rows, mean /
    min / max ceiling ratio, mean wait fraction and rate."""
    groups: dict = {}
    for r in rows:
        if "ceiling_ratio" in r:
            key = (r.get("config"), r["loader"], r["loop"], r["step"], r.get("compile_mode"), r.get("arch"),
                   r.get("cuda_device_max_connections"))
            groups.setdefault(key, []).append(r)
    out = []
    for (config, loader, loop, step, mode, arch, connections), rs in groups.items():
        ratios = [r["ceiling_ratio"] for r in rs]
        out.append({"config": config, "loader": loader, "loop": loop, "step": step, "compile_mode": mode, "arch": arch,
                    "connections": connections or "default", "rows": len(rs),
                    "ceiling_ratio": round(statistics.mean(ratios), 4), "min": min(ratios), "max": max(ratios),
                    "wait_fraction": round(statistics.mean(r["wait_fraction"] for r in rs), 4),
                    "rate": round(statistics.mean(r["rate"] for r in rs), 1)})
    return out


def earlier_record(args) -> dict:
    """The ceiling.json already in ``--out`` (``{}`` if there is none)."""
    from bench.common import read_result

    return read_result("ceiling", args.out) or {}


def appended(earlier: dict, run: dict) -> dict:
    """``run``'s rows added to ``earlier``'s: the file keeps its own keys (its first run's date, settings and any
    probes), and each appended run's date, versions and settings go to ``appended``."""
    if earlier.get("gpu") != run["gpu"]:
        raise SystemExit(f"ceiling.py: --append: the file's rows were measured on {earlier.get('gpu')!r}, this run "
                         f"is on {run['gpu']!r}; give another --out")
    out = {k: v for k, v in earlier.items() if k not in ("environment", "summary", "seconds")}
    keys = ("date", "versions", "config", "cpu_count", "cuda_device_max_connections", "cuda_visible_devices",
            "usable_cores")
    out["appended"] = earlier.get("appended", []) + [{k: run.get(k) for k in keys}]
    run["rows"][:0] = earlier.get("rows", [])
    out["rows"] = run["rows"]
    return out


def next_round(rows: list[dict], step: str | None = None) -> int:
    """The round number after the last of ``rows`` (of this ``step``, "eager" or "compiled", if given): --append
    goes on."""
    return 1 + max((r.get("round", -1) for r in rows if step is None or r.get("step") == step), default=-1)


def merged(runs: list[dict]) -> dict:
    """One record of runs made side by side, one round each on its own GPU of one host (each run's rounds
    numbered by ``--first-round``): the first run's keys, the others' in ``appended``, every row, their summary.
    Two runs with a round of the same number, or on GPUs of different names, are refused."""
    rounds = [{r.get("round") for r in run.get("rows", [])} for run in runs]
    if any(a & b for i, a in enumerate(rounds) for b in rounds[i + 1:]):
        raise SystemExit("ceiling_record: two runs hold rounds of the same number: give each --first-round")
    out = dict(runs[0])
    for run in runs[1:]:
        out = appended(out, dict(run))
    out["summary"] = summary(out["rows"])
    return out


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m bench.ceiling_record OUT_DIR RUN.json [RUN.json ...]\n"
              "merge runs of bench/ceiling.py made side by side (one --first-round each, one GPU each) into "
              "OUT_DIR/ceiling.json", file=sys.stderr)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    from bench.common import write_result

    runs = []
    for path in sys.argv[2:]:
        with open(path) as f:
            runs.append({k: v for k, v in json.load(f).items() if k != "environment"})
    print("wrote", write_result("ceiling", merged(runs), sys.argv[1]))
