"""Peers side by side: datapipe against torch (loose files), webdataset, litdata and MosaicML Streaming.

The same JPEGs, written by each system in its own format with its own writer and read with its
documented loader, shuffle on, every row in a fresh process (``datapipe.tools.bench.peers``): write
throughput; raw bytes at each ``--workers`` (epoch 1 in the fresh process, epoch 2); PIL decode +
random-resized-crop in ``--decode-workers`` workers (steady rate, first batch, peak PSS); mid-epoch resume
(time to the first batch after loading a state, and whether the rest is exact). Writes
``bench/results/peers.json`` and ``peers.png`` (the H200 host's run is kept beside it as ``peers_h200.json``);
the table goes to stdout.

litdata and MosaicML rows need them installed: ``pip install -c constraints.txt -e '.[peers]'``
(where pip refuses their pins beside the rest, install them into a folder of their own with
``pip install --target DIR litdata mosaicml-streaming`` and run with ``PYTHONPATH=DIR``). Systems not
installed are listed as such.

The H200 run (16 cores, 20k ImageNet-like JPEGs of ~110 KB, batch 256, data in the page cache):

    python bench/peers.py --num-images 20000 --batch-size 256 --workers 0,4,8 --decode-workers 14

The 2-core machine (a few minutes):

    python bench/peers.py --num-images 600 --batch-size 64 --workers 0,2 --decode-workers 2

``--source DIR`` measures your own images (a folder of class folders of JPEGs) instead.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import table, write_result  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=None, help="class folders of JPEGs (default: made in --data)")
    p.add_argument("--data", default="/tmp/datapipe-bench-peers", help="where the made images and formats go")
    p.add_argument("--num-images", type=int, default=20000, help="images to make when there is no --source")
    p.add_argument("--systems", default="torch,webdataset,datapipe,litdata,mosaicml")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", default="0,4,8", help="worker processes of the raw-bytes rows (comma list)")
    p.add_argument("--decode-workers", type=int, default=None, help="workers of the decode row (default: cores)")
    p.add_argument("--resume-workers", type=int, default=0, help="workers of the resume rows")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (60 small images, batch 8)")
    p.add_argument("--note", default=None, help="a sentence about this run, kept in the JSON")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)

    from datapipe.tools import plots
    from datapipe.tools.bench import peers

    size = (500, 375)
    if args.quick:
        args.num_images, args.batch_size, args.workers, args.image_size = 60, 8, "0,2", 32
        args.decode_workers, size = 2, (96, 72)
        args.data = args.data.rstrip("/") + "-quick"
    source = args.source or peers.make_image_folder(os.path.join(args.data, f"images-{args.num_images}"),
                                                    num_images=args.num_images, size=size)
    result = peers.run_peers(source, work_dir=os.path.join(args.data, "formats"),
                             systems=args.systems.split(","), batch_size=args.batch_size,
                             workers=tuple(int(w) for w in args.workers.split(",")),
                             decode_workers=args.decode_workers, resume_workers=args.resume_workers,
                             image_size=args.image_size, timeout=args.timeout,
                             on_system=lambda so_far: write_result("peers", so_far, args.out))
    result["command"] = "python bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.note:
        result["note"] = args.note
    path = write_result("peers", result, args.out)
    plots.plot_peers(result, os.path.splitext(path)[0] + ".png")
    print(table(peers.table_rows(result), ["row"] + list(result["systems"])))
    for line in peers.run_notes(result):
        print(line)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
