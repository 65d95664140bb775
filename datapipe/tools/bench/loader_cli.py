"""``datapipe bench``: ``storage`` (datapipe.tools.bench.storage) and ``loader`` (datapipe.tools.bench.loader).

The command line module lives in ``loaders`` because the loader benchmark drives the loaders;
``datapipe.tools.bench.cli`` holds the shared pieces and the storage command.
"""
from __future__ import annotations

import argparse
import os
import sys

from datapipe.tools.bench.cli import _outputs, _storage_command, plot_path, table
from datapipe.errors import DataError
from datapipe.image_bytes import IMAGE_ENTRIES
from datapipe.storage.urls import redact_text


# ---- loader ---------------------------------------------------------------------------------------
def _loader_command(args) -> int:
    from datapipe.tools.bench import loader as bl
    from datapipe.tools.bench.storage import parse_list

    try:
        result = bl.run_loader(args.data, pipelines=parse_list(args.pipelines, str) if args.pipelines else None,
                               batch_size=args.batch_size, workers=args.workers, device=args.device,
                               steps=args.steps, warmup=args.warmup, image_size=args.image_size,
                               make_images=args.make_images, seq_len=args.seq_len, progress=not args.no_progress)
    except (DataError, OSError, ValueError) as e:
        print(f"datapipe bench loader: {redact_text(e)}", file=sys.stderr)
        return 1
    print(table(bl.rows_for_table(result), bl.TABLE_COLUMNS))
    print()
    print(table(bl.stage_rows(result), bl.STAGE_COLUMNS))
    print(f"bottleneck: {result['bottleneck']['stage']} ({result['bottleneck']['text']})")
    failed = [p for p in result["pipelines"] if p.get("error")]
    for p in failed:
        print(f"{p['name']}: {'' if p['error'].startswith('refused:') else 'failed: '}{p['error']}", file=sys.stderr)
    if args.peers:
        try:
            result["peers"] = _peers(args)
        except (DataError, OSError, ValueError) as e:
            print(f"datapipe bench loader --peers: {redact_text(e)}", file=sys.stderr)
            return 1
        from datapipe.tools.bench.peer_table import how_lines, run_notes, table_rows

        print()
        print(table(table_rows(result["peers"]), ["row"] + list(result["peers"]["systems"])))
        for line in run_notes(result["peers"]) + how_lines(result["peers"]):
            print(line)
    _outputs(args, result, "loader")
    png = plot_path(args)
    if png and "peers" in result:
        from datapipe.tools.plots import missing, plot_peers

        if not missing():  # else _outputs said why there is no plot
            print(f"wrote {plot_peers(result['peers'], os.path.splitext(png)[0] + '_peers.png')}", file=sys.stderr)
    return 1 if failed and len(failed) == len(result["pipelines"]) else 0


def _peers(args) -> dict:
    """The peers' rows (datapipe.tools.bench.peers) on the images of the loader's shards."""
    import tempfile

    from datapipe.tools.bench import peers
    from datapipe.tools.bench.storage import parse_list, resolve

    with tempfile.TemporaryDirectory(prefix="datapipe-peers-") as tmp:
        source = peers.folder_from_shards(resolve([args.data]), f"{tmp}/images")
        workers = tuple(parse_list(args.peers_workers))
        return peers.run_peers(source, work_dir=f"{tmp}/formats", batch_size=args.batch_size, workers=workers,
                               decode_workers=args.workers, resume_workers=min(4, max(workers)),
                               image_size=args.image_size, progress=not args.no_progress)


# ---- CLI ------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write every figure as JSON to this file")
    p.add_argument("--plot", default=None, help="PNG plot (default: next to --json)")
    p.add_argument("--no-plot", action="store_true", help="no PNG even with --json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT")
    s = sub.add_parser("storage", help="raw read, ShardStream and a concurrency x block-size sweep of shards",
                       description="How fast your storage serves shards: raw reads, ShardStream reads and a "
                                   "concurrency x block-size sweep (threads, and processes with --processes), then "
                                   "what to set (how many workers read in parallel). Warns when the data set is too "
                                   "small to measure.")
    s.add_argument("urls", nargs="+", help="shard files, brace specs or directories (local or any fsspec URL)")
    s.add_argument("--concurrency", default="1,2,4,8", help="readers in parallel (default 1,2,4,8)")
    s.add_argument("--block-size", default="1M,4M,16M", help="bytes per request (default 1M,4M,16M)")
    s.add_argument("--seconds", type=float, default=5.0, help="cap per measurement (default 5)")
    s.add_argument("--processes", action="store_true", help="sweep with processes as well as threads")
    s.add_argument("--storage-options", default=None,
                   help='fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'')
    _common(s)
    lo = sub.add_parser("loader", help="the same dataset through several loaders, with a per-stage breakdown",
                        description="The same dataset through several loaders, with a per-stage breakdown. The "
                                    "consume step is a stand-in reduction, not a training step: no ceiling_ratio "
                                    "(use `datapipe doctor --ceiling-steps N -- train.py` for that).")
    lo.add_argument("data", help="a shard directory or spec: image shards (an image entry of any type `datapipe "
                                 f"shard` writes: {', '.join(IMAGE_ENTRIES)}; and cls) or token shards (npy)")
    lo.add_argument("--pipelines", default=None,
                    help="comma list of torch, webdataset, dali, datapipe-images, datapipe-loader (image data); "
                         "datapipe-tokens, naive-pad (token data). Default: all that fit the data")
    lo.add_argument("--batch-size", type=int, default=64, help="samples per batch (default 64)")
    lo.add_argument("--workers", type=int, default=None, help="loader workers / DALI threads (default: cores)")
    lo.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where batches land (default cpu)")
    lo.add_argument("--steps", type=int, default=20, help="timed batches per pipeline (default 20)")
    lo.add_argument("--warmup", type=int, default=2, help="untimed batches first (default 2)")
    lo.add_argument("--image-size", type=int, default=224, help="output height and width of image pipelines (default 224)")
    lo.add_argument("--seq-len", type=int, default=2048, help="row length for token data (default 2048)")
    lo.add_argument("--make-images", type=int, default=0, metavar="N",
                    help="if DATA is empty or missing, write N ImageNet-like JPEGs there first")
    lo.add_argument("--peers", action="store_true",
                    help="also torch (loose files), webdataset, datapipe, litdata, MosaicML Streaming, SPDL, Grain "
                         "and Megatron-Energon, each writing these images in its own format: write rate, raw "
                         "bytes, first batch, mid-epoch resume, decode, peak PSS (the peers when installed: "
                         "scripts/setup-venv.sh installs them; bench/peers.py --help says how)")
    lo.add_argument("--peers-workers", default="0,4,8",
                    help="worker counts of the peers' raw-bytes rows (default 0,4,8; on a 2-core machine 0,2)")
    _common(lo)
    parser.set_defaults(_parser=parser)


def run_command(args: argparse.Namespace) -> int:
    if args.what == "storage":
        return _storage_command(args)
    if args.what == "loader":
        return _loader_command(args)
    args._parser.print_help(sys.stderr)
    return 2


