"""Preprocessing throughput: ``datapipe shard`` (local engine, 1..N workers) against a plain loop.

The input is an ImageNet-like image folder (real JPEG photographs from
:func:`datapipe.synthetic.iter_image_samples`, class sub-folders). The baseline is what people
write by hand: one process walks the folder and writes samples with ``webdataset.ShardWriter``.
Two modes: ``copy`` (bytes as they are) and ``resize`` (decode, shrink to a shorter side of 256,
re-encode as JPEG 90: the baseline does the same PIL work in its loop). Results go to
``bench/results/preprocess.json``.

    python -m bench.preprocess --images 2000 --workers 1,2,4,8,16
    python -m bench.preprocess --quick
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import table, write_result  # noqa: E402


def make_folder(root: str, n: int, classes: int) -> int:
    """Write ``n`` JPEGs into ``root/<class>/``; returns the total bytes (reuses a complete folder)."""
    from datapipe.synthetic import iter_image_samples

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--workers", default="1,2,4,8,16", help="comma list; counts above the CPU count are dropped")
    p.add_argument("--modes", default="copy,resize")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="shard size (default 64 MiB)")
    p.add_argument("--data-dir", default=None, help="where to keep the image folder (default: a temp dir)")
    p.add_argument("--device", default="cpu", help="unused (CPU only); accepted for symmetry with other benches")
    p.add_argument("--quick", action="store_true", help="200 images, workers 1,2")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.workers = 200, "1,2"
    cpus = os.cpu_count() or 1
    workers = [w for w in (int(x) for x in args.workers.split(",")) if w <= cpus] or [1]
    import webdataset  # noqa: F401  (imported before timing: both sides start warm)
    from PIL import Image  # noqa: F401

    from datapipe.preprocess import shard

    tmp = tempfile.mkdtemp(prefix="bench-preprocess-")
    root = args.data_dir or os.path.join(tmp, "images")
    t = time.perf_counter()
    total = make_folder(root, args.images, args.classes)
    print(f"image folder: {args.images} images, {total / 1e6:.1f} MB ({time.perf_counter() - t:.1f} s to make)",
          file=sys.stderr)
    rows = []
    try:
        for mode in args.modes.split(","):
            resize = 256 if mode == "resize" else None
            out = os.path.join(tmp, "baseline")
            t = time.perf_counter()
            n = baseline(root, out, resize=resize, max_bytes=args.max_bytes)
            dt = time.perf_counter() - t
            shutil.rmtree(out)
            rows.append({"mode": mode, "impl": "webdataset loop", "workers": 1, "images": n, "seconds": round(dt, 3),
                         "images_per_s": round(n / dt, 1), "MB_per_s": round(total / 1e6 / dt, 1)})
            for w in workers:
                out = os.path.join(tmp, f"dp-{w}")
                t = time.perf_counter()
                report = shard(root, out, workers=w, resize=resize, quality=90 if resize else None,
                               max_bytes=args.max_bytes, progress=False)
                dt = time.perf_counter() - t
                shutil.rmtree(out)
                rows.append({"mode": mode, "impl": "datapipe shard", "workers": w, "images": report["samples"],
                             "seconds": round(dt, 3), "images_per_s": round(report["samples"] / dt, 1),
                             "MB_per_s": round(total / 1e6 / dt, 1), "partitions": report["partitions"],
                             "shards": report["shards"]})
                print(rows[-1], file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for mode in args.modes.split(","):
        base = next(r for r in rows if r["mode"] == mode and r["impl"] == "webdataset loop")
        for r in rows:
            if r["mode"] == mode:
                r["speedup"] = round(r["images_per_s"] / base["images_per_s"], 2)
    path = write_result("preprocess", {
        "config": {"images": args.images, "classes": args.classes, "input_MB": round(total / 1e6, 1),
                   "max_bytes": args.max_bytes, "workers": workers, "quick": args.quick,
                   "note": "MB/s counts input image bytes; resize = shorter side 256, JPEG q90"},
        "rows": rows,
    }, args.out)
    print(table(rows, ["mode", "impl", "workers", "images", "seconds", "images_per_s", "MB_per_s", "speedup"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
