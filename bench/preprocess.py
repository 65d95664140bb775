"""Preprocessing throughput: ``datapipe shard`` against the plain loop it replaces, in the same run.

The input is an ImageNet-like image folder (real JPEG photographs from
:func:`datapipe.tools.synthetic.iter_image_samples`, class sub-folders). The baseline is what people
write by hand: one process walks the folder and writes samples with ``webdataset.ShardWriter``.
Two modes: ``copy`` (bytes as they are; datapipe checks every image, ``--check-images open`` by
default and ``decode``, at 1 and N workers, plus both sides end to end in a fresh interpreter) and
``resize`` (decode, shrink to a shorter side of 256, re-encode as JPEG 90 at 1..N workers: the
baseline does the same PIL work in its loop). Results go to ``bench/results/preprocess.json``.

    python -m bench.preprocess --images 3000 --classes 10 --workers 1,2,4,8,16
    python -m bench.preprocess --quick
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import table, write_result  # noqa: E402


def make_folder(root: str, n: int, classes: int) -> int:
    """Write ``n`` JPEGs into ``root/<class>/``; returns the total bytes (reuses a complete folder)."""
    from datapipe.tools.synthetic import iter_image_samples

    marker = os.path.join(root, f".complete-{n}-{classes}")
    if not os.path.exists(marker):
        shutil.rmtree(root, ignore_errors=True)
        for s in iter_image_samples(n, num_classes=classes):
            d = os.path.join(root, f"class{int(s['cls']):04d}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{s['__key__']}.jpg"), "wb") as f:
                f.write(s["jpg"])
        open(marker, "w").close()
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".jpg"))


def baseline(root: str, out: str, *, resize: int | None, max_bytes: int) -> int:
    """Single-process loop with webdataset.ShardWriter; returns the number of samples."""
    import webdataset
    from PIL import Image

    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    os.makedirs(out, exist_ok=True)
    n = 0
    with webdataset.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=max_bytes, maxcount=10**9,
                                verbose=0) as sink:
        for ci, c in enumerate(classes):
            for name in sorted(os.listdir(os.path.join(root, c))):
                with open(os.path.join(root, c, name), "rb") as f:
                    data = f.read()
                if resize:
                    im = Image.open(io.BytesIO(data)).convert("RGB")
                    s = resize / min(im.size)
                    if s < 1:
                        im = im.resize((round(im.width * s), round(im.height * s)), Image.Resampling.BICUBIC,
                                       reducing_gap=3.0)
                    buf = io.BytesIO()
                    im.save(buf, format="JPEG", quality=90)
                    data = buf.getvalue()
                sink.write({"__key__": f"{c}/{name[:-4]}", "jpg": data, "cls": str(ci).encode()})
                n += 1
    return n


def _run(rows: list, tmp: str, cases: list, total: int, repeat: int = 1) -> None:
    """Time each ``(label, fn)`` of ``cases`` ``repeat`` times, the cases interleaved round by round (a
    shared machine's load drifts; interleaving spreads it over all cases); each row keeps the best time."""
    times: list[list[float]] = [[] for _ in cases]
    results: list = [None] * len(cases)
    out = os.path.join(tmp, "out")
    for _ in range(repeat):
        for i, (label, fn) in enumerate(cases):
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            results[i] = fn(out)
            times[i].append(time.perf_counter() - t)
            shutil.rmtree(out, ignore_errors=True)
    for (label, _), (n, extra), ts in zip(cases, results, times):
        dt = min(ts)
        rows.append({**label, "images": n, "seconds": round(dt, 3), "images_per_s": round(n / dt, 1),
                     "MB_per_s": round(total / 1e6 / dt, 1), "runs_s": [round(x, 3) for x in ts], **extra})
        print(rows[-1], file=sys.stderr)


def _cli(argv: list[str]) -> tuple[int, dict]:
    """Run a command end to end (a fresh interpreter: imports and start-up included); returns (images, {})."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed: {done.stderr.strip()[-500:]}")
    if argv[1] == "-c":
        return int(done.stdout.strip().split()[-1]), {}
    return int(done.stdout.split(": ", 1)[1].split()[0]), {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--workers", default="1,2,4,8,16", help="comma list; counts above the CPU count are dropped")
    p.add_argument("--modes", default="copy,resize")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="shard size (default 1 GiB, datapipe's default)")
    p.add_argument("--data-dir", default=None, help="where to keep the image folder (default: a temp dir)")
    p.add_argument("--device", default="cpu", help="unused (CPU only); accepted for symmetry with other benches")
    p.add_argument("--repeat", type=int, default=5, help="rounds of the copy-mode rows, best kept (default 5)")
    p.add_argument("--quick", action="store_true", help="200 images, workers 1,2")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.workers = 200, "1,2"
    cpus = os.cpu_count() or 1
    workers = [w for w in (int(x) for x in args.workers.split(",")) if w <= cpus] or [1]
    import webdataset  # noqa: F401  (imported before timing: both sides start warm)
    from PIL import Image  # noqa: F401

    from datapipe.jobs.shard.job import shard

    tmp = tempfile.mkdtemp(prefix="bench-preprocess-")
    root = args.data_dir or os.path.join(tmp, "images")
    t = time.perf_counter()
    total = make_folder(root, args.images, args.classes)
    print(f"image folder: {args.images} images, {total / 1e6:.1f} MB ({time.perf_counter() - t:.1f} s to make)",
          file=sys.stderr)
    baseline(root, os.path.join(tmp, "warm"), resize=None, max_bytes=args.max_bytes)  # page cache warm for all
    shutil.rmtree(os.path.join(tmp, "warm"))
    rows: list[dict] = []

    def ours(w: int, resize: int | None, check: str):
        def fn(out):
            r = shard(root, out, workers=w, resize=resize, quality=90 if resize else None, check_images=check,
                      max_bytes=args.max_bytes, progress=False)
            return r["samples"], {"partitions": r["partitions"], "shards": r["shards"]}
        return fn

    try:
        for mode in args.modes.split(","):
            resize = 256 if mode == "resize" else None
            cases = [({"mode": mode, "impl": "webdataset loop", "check": "none", "workers": 1},
                      lambda out: (baseline(root, out, resize=resize, max_bytes=args.max_bytes), {}))]
            if mode == "copy":
                for check in ("none", "open", "decode"):
                    for w in sorted({1, workers[-1]}) if check != "none" else [1]:
                        cases.append(({"mode": mode, "impl": "datapipe shard", "check": check, "workers": w},
                                      ours(w, None, check)))
                # end to end, as a user runs them: a fresh interpreter each (imports and start-up included)
                cases.append(({"mode": mode, "impl": "webdataset loop, own process", "check": "none", "workers": 1},
                              lambda out: _cli([sys.executable, "-c", "from bench.preprocess import baseline; "
                                                f"print(baseline({root!r}, {out!r}, resize=None, "
                                                f"max_bytes={args.max_bytes}))"])))
                cases.append(({"mode": mode, "impl": "datapipe shard CLI", "check": "open", "workers": cpus},
                              lambda out: _cli([sys.executable, "-m", "datapipe", "shard", root, out, "--no-progress",
                                                "--max-bytes", str(args.max_bytes)])))
                _run(rows, tmp, cases, total, args.repeat)
            else:
                cases += [({"mode": mode, "impl": "datapipe shard", "check": "open", "workers": w},
                           ours(w, resize, "open")) for w in workers]
                _run(rows, tmp, cases, total, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for mode in args.modes.split(","):
        base = next(r for r in rows if r["mode"] == mode and r["impl"] == "webdataset loop")
        for r in rows:
            if r["mode"] == mode:
                r["vs_loop"] = round(r["images_per_s"] / base["images_per_s"], 2)
    path = write_result("preprocess", {
        "config": {"images": args.images, "classes": args.classes, "input_MB": round(total / 1e6, 1),
                   "max_bytes": args.max_bytes, "workers": workers, "cpu_count": cpus, "quick": args.quick,
                   "note": "MB/s counts input image bytes; resize = shorter side 256, JPEG q90; 'check' is "
                           "--check-images (open: PIL reads the header and size; decode: every pixel); rows "
                           "'own process' and 'CLI' include interpreter start-up and imports, the others run "
                           "in this process after imports; vs_loop = images/s over the webdataset loop's; "
                           f"copy rows: best of {args.repeat} interleaved rounds (runs_s lists them), "
                           "resize rows: one run each"},
        "rows": rows,
    }, args.out)
    print(table(rows, ["mode", "impl", "check", "workers", "images", "seconds", "images_per_s", "MB_per_s", "vs_loop"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
