"""Peers side by side: datapipe against torch (loose files), webdataset, litdata, MosaicML Streaming, SPDL, Grain
and Megatron-Energon.

The same JPEGs, written by each system in its own format with its own writer and read with its documented
loader, shuffle on, every row in a fresh process (``datapipe.tools.bench.peers``): write throughput; raw bytes
at each ``--workers`` (epoch 1 in the fresh process, epoch 2, construct + first batch); mid-epoch resume in
``--resume-workers`` workers (time to the first batch after loading a state, and whether the rest is exact);
PIL decode + random-resized-crop in ``--decode-workers`` workers (first batch, steady rate, peak PSS). Every
row says what the system did (format, API, workers or threads). The results are written after every row to
``bench/results/peers.json`` (``--name``), the PNG and the table at the end.

The peers need installing: ``pip install -c constraints.txt spdl grain megatron-energon`` and
``pip install --no-deps litdata==0.2.76 obstore==0.12.1`` (scripts/setup-venv.sh does both; MosaicML
Streaming 0.13 pins numpy<2.2: install it into a folder of its own with ``pip install --target DIR`` and run
with ``PYTHONPATH=DIR``). Systems not installed are listed as such. datapipe's own-decoder row
(``decode_own``: ``ImageLoader(device="cpu")``) needs DALI (the ``dali`` extra: ``nvidia-dali-cuda130``); without it
the row says so.

The run of record (the 16-core GPU host; 150,000 ImageNet-like JPEGs of ~100 KB, so that even the fastest reader's
epoch lasts 3 s or more; batch 256, in the page cache; each system's format removed once its rows are done, so the
disk holds the source and one format, ~30 GB; epochs cut at 3 s where slower peers take longer; two calls of a
420 s budget each, the second going on with the rows the first left):

    python bench/peers.py --num-images 150000 --batch-size 256 --workers 0,4,8 --resume-workers 4 \
        --decode-workers 14 --epoch-cap-s 3 --timeout 60 --budget-s 420 --drop-formats --name peers_h200
    python bench/peers.py ... the same ... --rest     # a second call: the rows the budget left unrun

The 2-core machine (a few minutes):

    python bench/peers.py --num-images 600 --batch-size 64 --workers 0,2 --resume-workers 2 --decode-workers 2

``--quick`` is a smoke run on tiny images (what CI runs: 0 and 2 workers, every worker path); ``--source DIR``
measures your own images (a folder of class folders of JPEGs) instead.

``--floor`` measures, instead, where one process's read time goes (bench/results/read_floor.json): a bare ``pread``,
ShardStream with and without its kept heap, the datapipe row's loader, a loose-files loop and torch's row, per
sample the user and system CPU and page faults (``datapipe.tools.bench.read_floor``):

    python bench/peers.py --floor        # 40,000 images, 3 passes per way, 3 rounds (~3 minutes on 16 cores)
    python bench/peers.py --floor --ways loader_w4,loader_w4_copied,loader_w8,loader_w8_copied   # workers' read A/B
    python bench/peers.py --floor --ways loader_w4,loader_w4_serial,loader_w8,loader_w8_serial   # reading ahead A/B
    python bench/peers.py --floor --ways loader_w4,loader_w4_deep,loader_w8,loader_w8_deep       # ... two ahead
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import read_result, result_path, table, write_result  # noqa: E402


def _save(name: str, result: dict, directory: str | None) -> str:
    """``write_result`` under a temporary name, then renamed: a run killed mid-write leaves the last whole file."""
    tmp = write_result(f"{name}.partial", result, directory)
    path = result_path(name, directory)
    os.replace(tmp, path)
    return path


def _floor(args, default_images: int) -> dict:
    from datapipe.tools.bench.read_floor import run_floor

    quick = args.quick
    images = 600 if quick else 40000 if args.num_images == default_images else args.num_images
    ways = {"ways": args.ways} if args.ways else {}
    result = run_floor(os.path.join(args.data, "floor"), num_images=images, epochs=2 if quick else 3,
                       rounds=1 if quick else 3, log=lambda line: print(line, file=sys.stderr), **ways)
    print(table(result["summary"], ["way", "epoch", "samples_per_s", "user_us", "sys_us", "main_thread_us", "main_busy",
                                     "faults"]))
    if not quick or args.out:
        print("wrote", write_result("read_floor", result, args.out), file=sys.stderr)
    return result


def main(argv=None) -> dict:
    from datapipe.tools.bench.peer_readers import SYSTEMS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=None, help="class folders of JPEGs (default: made in --data)")
    p.add_argument("--data", default="/tmp/datapipe-bench-peers", help="where the made images and formats go")
    p.add_argument("--num-images", type=int, default=50000, help="images to make when there is no --source")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", default="0,4,8", help="worker processes of the raw-bytes rows (comma list)")
    p.add_argument("--decode-workers", type=int, default=None, help="workers of the decode row (default: cores)")
    p.add_argument("--resume-workers", type=int, default=4, help="workers of the resume rows")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    p.add_argument("--epoch-cap-s", type=float, default=None, help="cut raw-bytes epochs after this many seconds")
    p.add_argument("--decode-seconds", type=float, default=3.0, help="seconds of steady decoding timed")
    p.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="a tiny smoke run (24 small images, batch 8, 0 and 2 workers; resume and decode in 2)")
    p.add_argument("--rest", action="store_true",
                   help="run only the rows that the results file already in --out (--name) left unrun at its budget, "
                        "on the same --data and settings, keeping its other rows: a run of record over two calls")
    p.add_argument("--drop-formats", action="store_true",
                   help="remove each system's format once its rows are done (disk for the source and one format)")
    p.add_argument("--note", default=None, help="a sentence about this run, kept in the JSON")
    p.add_argument("--name", default="peers", help="results file name (default peers: peers.json, peers.png)")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    p.add_argument("--floor", action="store_true",
                   help="instead: where one process's read time goes, per layer, from a bare pread up to the "
                        "datapipe and torch rows (datapipe.tools.bench.read_floor; read_floor.json; --num-images, "
                        "default 40,000 here; --quick: 600)")
    p.add_argument("--ways", default=None,
                   help="--floor: the ways to run, comma-separated (default all; see datapipe.tools.bench.read_floor)")
    args = p.parse_args(argv)
    if args.ways:
        from datapipe.tools.bench.read_floor import WAYS

        args.ways = tuple(w.strip() for w in args.ways.split(",") if w.strip())
        unknown = sorted(set(args.ways) - set(WAYS))
        if unknown:
            p.error(f"unknown --ways {', '.join(unknown)}: choose from {', '.join(WAYS)}")
    if args.floor:
        return _floor(args, p.get_default("num_images"))

    from datapipe.tools import plots
    from datapipe.tools.bench import peers

    size = (500, 375)
    if args.quick:
        args.num_images, args.batch_size, args.workers, args.image_size = 24, 8, "0,2", 16
        args.decode_workers, args.resume_workers, args.decode_seconds, size = 2, 2, None, (48, 36)
        args.data = args.data.rstrip("/") + "-quick"
    earlier = read_result(args.name, args.out) if args.rest else None
    if args.rest and earlier is None:
        p.error(f"--rest: there is no {result_path(args.name, args.out)} to go on from")
    t0 = time.perf_counter()
    source = args.source or peers.make_image_folder(os.path.join(args.data, f"images-{args.num_images}"),
                                                    num_images=args.num_images, size=size,
                                                    num_classes=3 if args.quick else 10)
    made_s = round(time.perf_counter() - t0, 1)
    command = "python bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    extra = {"command": command, "images_ready_s": made_s, **({"note": args.note} if args.note else {})}
    result = peers.run_peers(source, work_dir=os.path.join(args.data, "formats"),
                             systems=args.systems.split(","), batch_size=args.batch_size,
                             workers=tuple(int(w) for w in args.workers.split(",")),
                             decode_workers=args.decode_workers, resume_workers=args.resume_workers,
                             image_size=args.image_size, timeout=args.timeout, epoch_cap_s=args.epoch_cap_s,
                             decode_seconds=args.decode_seconds, budget_s=args.budget_s, earlier=earlier,
                             drop_formats=args.drop_formats,
                             on_row=lambda so_far: _save(args.name, {**so_far, **extra}, args.out))
    result.update(extra)
    path = _save(args.name, result, args.out)
    try:
        plots.plot_peers(result, os.path.splitext(path)[0] + ".png")
    except ImportError as e:  # matplotlib is the test extra's
        print(f"no plot: {e}", file=sys.stderr)
    print(table(peers.table_rows(result), ["row"] + list(result["systems"])))
    for line in peers.run_notes(result) + peers.how_lines(result):
        print(line)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
