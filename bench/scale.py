"""Cost at many shards: ShardStream construct, counts, the rank x worker plan, first sample and resume at 10k-1M shards.

Each size gets a folder whose ``manifest.json`` lists N shards ``shard-0000000.tar``... of ``--per-shard`` tiny
samples. Writing a million real tars is slow and takes gigabytes, so the names are symlinks to 16 real tars
(written once with webdataset's writer, each holding ``--per-shard`` samples): every shard opens and reads like
a real one, and the manifest is what a real million-shard set's would be. The folders are made once under
``--root`` and reused.

Each step runs in a fresh Python process (imports included), over the folder URL, ``shuffle=True``, rank 0 of 8:

- ``expand``: ``expand_urls`` of the N-URL brace pattern ``shard-{0000000..N-1}.tar`` (seconds, RSS growth);
- ``cold``: construct, counts, the first sample, then the plans of all 8 ranks x 2 workers (seconds each, and
  the process's peak RSS), on the first open ever (no local copy): the columns that the manifest's writer left
  beside it (``manifest.columns.npz``) are read once its JSON's sha256 matches;
- ``cold_json``: the same for a manifest without that sidecar (written by other tools): its JSON is parsed;
- ``stream``: the same on a restart, where the manifest's compact local copy (``datapipe.tar.manifest_cache``,
  kept for manifests of 4 MB and more) is read instead;
- ``pattern``: the same as ``stream`` over the brace pattern instead of the folder;
- ``resume``: construct, ``load_state_dict`` of a state taken mid-epoch (by another process), first sample;
  ``resume_extra_s`` is its time past a fresh stream's construct + counts + first sample;
- ``loader``: ``loaders.DataLoader(stream, batch_size=32, num_workers=2)``'s first batch.

Every size and step runs ``--repeat`` rounds (interleaved, since the machine may be shared) and each figure is
its least over them. ``growth`` gives each step's time at a size over its time at 10x fewer shards (linear: ~10;
figures of 2 ms or less at the smaller size are left out: noise and fixed costs, not growth).

    python bench/scale.py              # 10k, 100k, 1M shards: bench/results/scale.json
    python bench/scale.py --sizes 100000 --steps stream
    python bench/scale.py --quick      # smoke check (100 and 1k shards, nothing written to results/)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL = 16  # real tars behind the symlinks
STEPS = ("expand", "cold", "cold_json", "stream", "pattern", "resume", "loader")
GOALS = {"total_s": 2.0, "peak_rss_mb": 300.0, "resume_extra_s": 0.2, "expand_s": 1.0, "growth": 11.0}


def make_dataset(root: str, n: int, per_shard: int) -> str:
    """``root/<n>/``: a manifest of ``n`` shards (symlinks to ``REAL`` real tars); made once, then reused."""
    import webdataset

    from datapipe.tar.manifest import make_manifest, write_manifest

    folder = os.path.join(root, f"{n}x{per_shard}")
    from datapipe.tar import manifest_cache
    from datapipe.tar.manifest import SIDECAR_NAME

    made = os.path.join(folder, "manifest.json")
    if os.path.exists(made) and (os.path.getsize(made) < manifest_cache.MIN_BYTES
                                 or os.path.exists(os.path.join(folder, SIDECAR_NAME))):
        return folder  # (one made before the shard writers left a sidecar beside a large manifest: written again)
    real = os.path.join(root, f"real-{per_shard}")
    os.makedirs(real, exist_ok=True)
    sizes = []
    for r in range(REAL):
        path = os.path.join(real, f"r{r:02d}.tar")
        if not os.path.exists(path):
            with webdataset.TarWriter(path + ".tmp") as w:
                for i in range(per_shard):
                    w.write({"__key__": f"r{r:02d}-{i:04d}", "bin": bytes([r, i % 256]) * 8, "cls": b"%d" % (i % 7)})
            os.replace(path + ".tmp", path)
        sizes.append(os.path.getsize(path))
    os.makedirs(folder, exist_ok=True)
    entries = []
    for i in range(n):
        name = f"shard-{i:07d}.tar"
        link = os.path.join(folder, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(real, f"r{i % REAL:02d}.tar"), link)
        entries.append({"name": name, "count": per_shard, "bytes": sizes[i % REAL], "sha256": ""})
    from datapipe.tar.manifest import MANIFEST_NAME  # noqa: F401  (written last: its presence marks the folder done)

    write_manifest(folder, make_manifest(entries))
    return folder


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(step: str, folder: str, n: int, state_path: str) -> dict:
    """One step, timed in this (fresh) process."""
    t0 = time.perf_counter()
    out: dict = {}
    from datapipe.tar import manifest_cache

    if step == "cold_json":  # a manifest with no sidecar beside it: its JSON is parsed
        from datapipe.tar import manifest

        manifest.SIDECAR_NAME = "no-sidecar-here.npz"
    if step in ("cold", "cold_json"):  # no copy of the manifest yet
        import atexit
        import shutil

        manifest_cache.DEFAULT_DIR = tempfile.mkdtemp(prefix="scale-cold-")
        atexit.register(shutil.rmtree, manifest_cache.DEFAULT_DIR, True)
    else:
        manifest_cache.DEFAULT_DIR = os.path.join(folder, ".manifest-cache")
    if step == "expand":
        import datapipe

        base = _current_rss_mb()
        t = time.perf_counter()
        urls = datapipe.expand_urls(os.path.join(folder, f"shard-{{0000000..{n - 1:07d}}}.tar"))
        out["expand_s"] = time.perf_counter() - t
        assert len(urls) == n and urls[-1].endswith(f"{n - 1:07d}.tar")
        out["expand_rss_mb"] = _current_rss_mb() - base
        return out
    from datapipe import ShardStream

    out["import_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    spec = os.path.join(folder, f"shard-{{0000000..{n - 1:07d}}}.tar") if step == "pattern" else folder
    stream = ShardStream(spec, shuffle=True, rank=0, world_size=8)
    out["construct_s"] = time.perf_counter() - t
    if step == "state":
        it = iter(stream)
        for _ in range(5):
            next(it)
        with open(state_path, "w") as f:
            json.dump(stream.state_dict(), f)
        return out
    if step == "resume":
        with open(state_path) as f:
            state = json.load(f)
        t = time.perf_counter()
        stream.load_state_dict(state)
        out["load_state_s"] = time.perf_counter() - t
    t = time.perf_counter()
    total = sum(stream.counts)
    out["counts_s"] = time.perf_counter() - t
    assert total == n * stream.counts[0]
    if step == "loader":
        from loaders import DataLoader

        t = time.perf_counter()
        next(iter(DataLoader(stream, batch_size=32, num_workers=2, collate_fn=list)))
        out["first_batch_s"] = time.perf_counter() - t
        out["total_s"] = time.perf_counter() - t0 - out["import_s"]
        return out
    t = time.perf_counter()
    next(iter(stream))
    out["first_sample_s"] = time.perf_counter() - t
    out["fresh_s"] = time.perf_counter() - t0 - out["import_s"]
    out["fresh_peak_rss_mb"] = _rss_mb()
    if step in ("stream", "cold", "cold_json", "pattern"):
        from datapipe.order.plan import shard_order, worker_plan

        import numpy as np

        t = time.perf_counter()
        counts = np.array(stream.counts, dtype=np.int32)  # once per process, as the stream does
        order = shard_order(len(counts), shuffle=True, seed=0, epoch=0)  # the same for every rank
        for rank in range(8):
            for worker in range(2):
                plan = worker_plan(counts, order, rank=rank, world_size=8, worker=worker, num_workers=2)
                assert len(plan) == total // 16
        out["plan_8x2_s"] = time.perf_counter() - t
        out["total_s"] = time.perf_counter() - t0 - out["import_s"]
    out["peak_rss_mb"] = _rss_mb()
    return out


def run_child(step: str, folder: str, n: int, state_path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", step, "--folder", folder, "--n", str(n),
           "--state", state_path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{step} at {n} shards failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="shard counts")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--per-shard", type=int, default=4, help="samples per shard")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "datapipe-scale"),
                        help="where the shard folders are made (once) and reused")
    parser.add_argument("--repeat", type=int, default=None, help="rounds over all sizes and steps, each figure its "
                        "least (default 3; 1 with --quick)")
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="smoke check: 100 and 1k shards, results not written "
                        "unless --out is given")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.n, args.state)))
        return 0
    sizes = [100, 1_000] if args.quick else sorted(args.sizes)
    args.repeat = args.repeat or (1 if args.quick else 3)
    rows, runs = [], {}
    for n in sizes:
        t = time.perf_counter()
        folder = make_dataset(args.root, n, args.per_shard)
        rows.append({"shards": n, "samples": n * args.per_shard, "make_s": round(time.perf_counter() - t, 2)})
        run_child("state", folder, n, os.path.join(folder, "state.json"))  # also makes the copy restarts read
    steps = list(args.steps) + (["stream"] if "resume" in args.steps and "stream" not in args.steps else [])
    for _ in range(args.repeat):  # rounds over every size and step: a busy moment hits all sizes alike
        for row in rows:
            n = row["shards"]
            folder = os.path.join(args.root, f"{n}x{args.per_shard}")
            for step in steps:
                got = run_child(step, folder, n, os.path.join(folder, "state.json"))
                for k, v in got.items():
                    runs.setdefault((n, step, k), []).append(v)
    for row in rows:  # each figure: its least over the rounds (the machine is shared)
        n = row["shards"]
        row.update({f"{step}_{k}": round(min(v), 4) for (m, step, k), v in runs.items() if m == n and step in args.steps})
        if "resume" in args.steps:
            row["resume_resume_extra_s"] = round(min(runs[n, "resume", "fresh_s"]) - min(runs[n, "stream", "fresh_s"]), 4)
        print(json.dumps(row), flush=True)
    growth = {}
    for small, big in zip(rows, rows[1:]):
        if big["shards"] == 10 * small["shards"]:
            growth[f"{big['shards']}/{small['shards']}"] = {
                k: round(big[k] / small[k], 1) for k in big
                if k.endswith("_s") and k in small and small[k] > 0.002 and not k.startswith(("make", "resume_resume"))}
    result = {"what": "bench/scale.py: ShardStream costs over a manifest of N tiny shards (symlinks to 16 real tars), "
                      "each step in a fresh process, shuffle=True, rank 0 of 8",
              "per_shard": args.per_shard, "repeat": args.repeat, "goals_at_1M": GOALS, "rows": rows, "growth": growth}
    print(json.dumps(growth, indent=1))
    if args.out or not args.quick:
        from bench.common import write_result

        print("wrote", write_result("scale", result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
