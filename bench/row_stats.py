"""bench/ceiling.py rows pooled by variant, over one or more result files: n, mean, spread, and a 95%
confidence interval of the mean (Student's t), so a target such as "ImageLoader >= 0.98 of the ceiling"
is judged on all the rows measured with the same code, not on one row.

A row's variant is its name less a repeat mark (``imageloader2_nommap`` -> ``imageloader_nommap``); the
suffixes stay, since they change what was measured. Pool only files measured with the same code.

    python bench/row_stats.py bench/results/ceiling_nommap.json bench/results/ceiling_nommap_b.json
    python bench/row_stats.py bench/results/ceiling*.json --only imageloader,dali_hand --json out.json
    python bench/row_stats.py run1.json run2.json --against imageloader   # does a variant clear the defaults?
    python bench/row_stats.py bench/results/ceiling*.json --plot rows.png --target 0.98   # every row, drawn
    python bench/row_stats.py old.json "new.json::imageloader=imageloader_hostready"   # a file's variants renamed

A file named ``PATH::OLD=NEW,...`` has its variants renamed before pooling: rows of runs made after a
default changed pool with the rows that named the same setting explicitly.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ceiling import REPEAT_MARKS, image_variants, row_base, row_suffixes  # noqa: E402
from bench.common import table  # noqa: E402

OTHER_PARTS = ("torch_pil", "dl_ours", "dl_torch", "tokens", "tokens_llama", "tokens_worker")
# two-sided 95% Student's t by degrees of freedom (larger df: the nearest smaller entry; beyond 30: 1.96)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def known_variants() -> set[str]:
    """Every variant name bench/ceiling.py runs."""
    return set(image_variants(None, None, None)) | set(OTHER_PARTS)


def variant_key(name: str, known: set[str]) -> str:
    """``name`` less its repeat mark, suffixes kept in order (``imageloader2_legacy_sync10`` ->
    ``imageloader_legacy_sync10``); a base that is no known variant plus a mark stays as it is."""
    base = row_base(name)
    if base not in known and base[-1:] in REPEAT_MARKS and base[:-1] in known:
        base = base[:-1]
    return base + "".join(reversed(row_suffixes(name)))


def t95(df: int) -> float:
    if df < 1:
        return math.nan
    if df > 30:
        return 1.96
    return T95[max(k for k in T95 if k <= df)]


def summary(values: list[float]) -> dict:
    """n, mean, sd (sample), min, max and ``ci95``: the half-width of the mean's 95% interval (None for n < 2)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    ci = t95(n - 1) * sd / math.sqrt(n) if sd is not None else None
    return {"n": n, "mean": round(mean, 4), "sd": None if sd is None else round(sd, 4),
            "ci95": None if ci is None else round(ci, 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def gather(results: list[dict], key: str = "ceiling_ratio", only: set[str] | None = None,
           renames: list[dict[str, str]] | None = None) -> dict[str, list[float]]:
    """``{variant: [key of each of its rows]}`` for the ``results`` sections of ceiling result files;
    ``renames[i]`` (old variant -> new) applies to ``results[i]``."""
    known = known_variants()
    found: dict[str, list[float]] = defaultdict(list)
    for i, res in enumerate(results):
        rename = renames[i] if renames else {}
        for name, row in res.items():
            if isinstance(row, dict) and isinstance(row.get(key), (int, float)):
                variant = variant_key(name, known)
                variant = rename.get(variant, variant)
                if only is None or variant in only:
                    found[variant].append(float(row[key]))
    return dict(sorted(found.items()))


def pool(results: list[dict], key: str = "ceiling_ratio", only: set[str] | None = None) -> dict[str, dict]:
    """``{variant: summary of key over its rows}`` for the ``results`` sections of ceiling result files."""
    return {v: summary(vals) for v, vals in gather(results, key, only).items()}


def difference(base: list[float], other: list[float]) -> dict:
    """``other``'s mean less ``base``'s with the 95% interval of that difference (Welch: unequal
    variances, Welch-Satterthwaite degrees of freedom); ``clears``: the whole interval is above 0
    (``other`` is better where larger is better), ``below``: the whole interval is under 0."""
    if len(base) < 2 or len(other) < 2:
        return {"diff": None, "ci95": None, "clears": False, "below": False}
    a, b = summary(base), summary(other)
    va, vb = a["sd"] ** 2 / a["n"], b["sd"] ** 2 / b["n"]
    diff = sum(other) / len(other) - sum(base) / len(base)
    if va + vb == 0:
        return {"diff": round(diff, 4), "ci95": 0.0, "clears": diff > 0, "below": diff < 0}
    df = (va + vb) ** 2 / (va ** 2 / (a["n"] - 1) + vb ** 2 / (b["n"] - 1))
    half = t95(int(df)) * math.sqrt(va + vb)
    return {"diff": round(diff, 4), "ci95": round(half, 4), "df": round(df, 1),
            "clears": diff - half > 0, "below": diff + half < 0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench/ceiling.py result files (JSON)")
    ap.add_argument("--key", default="ceiling_ratio", help="the row figure to pool (default ceiling_ratio)")
    ap.add_argument("--only", default=None, help="comma-separated variants to keep")
    ap.add_argument("--against", default=None,
                    help="a variant: every other one's mean difference from it, with its 95%% interval (Welch)")
    ap.add_argument("--json", default=None, help="also write the pooled figures here")
    ap.add_argument("--plot", default=None, help="also draw every row and each mean's interval here (PNG)")
    ap.add_argument("--target", type=float, default=None, help="a target line on the plot (e.g. 0.98)")
    args = ap.parse_args(argv)
    results, renames = [], []
    for spec in args.files:
        path, _, pairs = spec.partition("::")
        try:
            renames.append(dict(pair.split("=", 1) for pair in pairs.split(",")) if pairs else {})
        except ValueError:
            ap.error(f"{spec}: rename as PATH::OLD=NEW[,OLD=NEW...]")
        with open(path) as f:
            results.append(json.load(f).get("results", {}))
    values = gather(results, args.key, set(args.only.split(",")) if args.only else None, renames)
    pooled = {v: summary(vals) for v, vals in values.items()}
    if args.against is not None:
        if args.against not in values:
            ap.error(f"--against {args.against}: no rows of it in these files")
        for v, s in pooled.items():
            if v != args.against:
                s["vs"] = {args.against: difference(values[args.against], values[v])}
    rows = [{"variant": v, **{k: x for k, x in s.items() if k != "vs"},
             **({"diff": s["vs"][args.against]["diff"], "diff_ci95": s["vs"][args.against]["ci95"],
                 "clears": s["vs"][args.against]["clears"]} if "vs" in s else {})} for v, s in pooled.items()]
    columns = ["variant", "n", "mean", "ci95", "sd", "min", "max"]
    print(table(rows, columns + (["diff", "diff_ci95", "clears"] if args.against else [])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": args.files, "key": args.key, "pooled": pooled}, f, indent=1)
    if args.plot:
        from datapipe.tools.plots import plot_rows

        print(f"wrote {plot_rows(values, pooled, args.plot, target=args.target, xlabel=args.key)}")
    return pooled


if __name__ == "__main__":
    main()
