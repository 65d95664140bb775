"""``datapipe shard SRC OUT``: the command line of the shard job (:mod:`datapipe.jobs.shard.job`).

``configure_parser`` declares the options, ``run_command`` runs the job and turns its outcome into
one line and an exit status: 0 done, 2 a usage mistake, 1 a failure (no traceback unless ``-v``),
130 interrupted (Ctrl-C: the journal keeps what is done; the same command resumes).
"""
from __future__ import annotations

import argparse
import sys

from datapipe.errors import DataError
from datapipe.storage.urls import redact_text
from datapipe.units import parse_size
from datapipe.jobs.shard.job import reads_all, shard
from datapipe.jobs.shard.lock import LockedError
from datapipe.jobs.shard.options import CHECKS, ENGINES, ImageOptions, ShardOptions, TextOptions, UsageError
from datapipe.jobs.shard.sources import KINDS
from datapipe.words import counted


def _size(text: str) -> int:
    """A byte count for argparse: ``datapipe.units.parse_size`` with argparse's error type."""
    try:
        return parse_size(text, minimum=0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DESCRIPTION = ("Convert an image folder (class sub-folders), a CSV/JSONL list of image paths and labels, JSONL/Parquet "
               "text or tar shards into WebDataset shards and a manifest.json. Images are shuffled across the "
               "input (seeded) and checked before they are copied (--check-images): the default check reads each "
               "image's header and end, not its pixels.")

CHECK_HELP = ("how images are checked before they are copied: 'open' (default: PIL reads the header and a JPEG must "
              "end with its end marker, a PNG with IEND: catches non-images, empty and cut-short files; no pixel "
              "is decoded, so damage inside the image data passes and shows up only in the loader: a decode "
              "error that on_error counts, or a part the decoder fills in gray), 'decode' (also decodes every "
              "pixel with PIL: catches damaged PNG/GIF/WebP/TIFF data; a JPEG whose scan data is damaged but "
              "still ends in its end marker is filled in by libjpeg without an error and passes even this), "
              "'none' (unsafe: damaged files reach the shards). A bare --check-images means 'decode'")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("src", help="image folder (class sub-folders), .csv/.jsonl list of images (path and label "
                                    "columns/fields, paths relative to the list; a label is a class name or an "
                                    "integer index, a JSONL row with any other label is skipped), JSONL/Parquet "
                                    "text (file or folder), or tar shards (file, folder, brace spec or glob)")
    parser.add_argument("out", help="output folder (local path or fsspec URL)")
    parser.add_argument("--input-kind", default="auto", choices=KINDS, help="what SRC is (default: guess)")
    parser.add_argument("--max-bytes", type=_size, default=1 << 30, help="shard size limit (default 1G)")
    parser.add_argument("--max-count", type=int, default=100_000, help="samples per shard limit (default 100000)")
    parser.add_argument("--pattern", default="shard-%06d.tar", help="shard file names (default shard-%%06d.tar)")
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false", default=True,
                        help="keep the input order (default: samples shuffled across the input, seeded)")
    parser.add_argument("--shuffle", dest="shuffle", action="store_true",
                        help="shuffle the samples: the default (accepted for older scripts)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0): the same seed, the same shards")
    parser.add_argument("--resize", type=int, metavar="SHORT_SIDE", help="shrink images to this shorter side")
    parser.add_argument("--quality", type=int, metavar="Q", help="re-encode images as JPEG of this quality")
    parser.add_argument("--check-images", nargs="?", const="decode", default="open", choices=CHECKS,
                        help=CHECK_HELP)
    parser.add_argument("--text-field", help="text field of JSONL/Parquet records (default 'text')")
    parser.add_argument("--key-field", help="record field to use as sample key (default: file and offset)")
    parser.add_argument("--tokenizer", help="text input: also store each record's token ids as an int32 .npy entry "
                                            "beside its .txt ('byte': UTF-8 bytes as ids; or a Hugging Face "
                                            "tokenizer.json; no EOS is added); TokenLoader reads them")
    parser.add_argument("--index", action="store_true", help="write DALI index files (.idx) beside the shards")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count)")
    parser.add_argument("--engine", default="local", choices=ENGINES, help="local process pool or Ray Data")
    parser.add_argument("--partition-size", type=int, help="items per partition (default: about 2 shards)")
    parser.add_argument("--partition-bytes", type=_size, default=32 << 20, help="JSONL bytes per partition")
    parser.add_argument("--strict", action="store_true", help="fail on the first unreadable input item")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> ShardOptions:
    """The :class:`ShardOptions` the command line asks for (raises UsageError for a bad value)."""
    return ShardOptions(
        kind=args.input_kind, pattern=args.pattern, max_bytes=args.max_bytes, max_count=args.max_count,
        shuffle=args.shuffle, seed=args.seed, index=args.index, strict=args.strict, overwrite=args.overwrite,
        partition_size=args.partition_size, partition_bytes=args.partition_bytes,
        images=ImageOptions(check=args.check_images, resize=args.resize, quality=args.quality),
        text=TextOptions(text_field=args.text_field, key_field=args.key_field, tokenizer=args.tokenizer))


def run_command(args: argparse.Namespace) -> int:
    try:
        report = shard(args.src, args.out, options_from_args(args), engine=args.engine, workers=args.workers,
                       progress=not args.no_progress)
    except KeyboardInterrupt:
        print("datapipe shard: interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    except UsageError as e:
        print(f"datapipe shard: error: {redact_text(e)}", file=sys.stderr)
        return 2
    except (ValueError, DataError, OSError, LockedError, ImportError) as e:
        print(f"datapipe shard: failed: {redact_text(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # one line, no traceback (``datapipe -v`` shows it)
        if getattr(args, "verbose", False):
            raise
        print(f"datapipe shard: failed: {type(e).__name__}: {redact_text(e)} (run `datapipe -v shard ...` for the traceback)",
              file=sys.stderr)
        return 1
    lost = report.get("num_lost_samples") or 0
    done = report.get("status") == "already complete"  # the same job over the same input, finished and verified
    if done:
        skipped = report.get("num_skipped") or 0
        print(f"{report['out']} already holds this job's output (same input and options, every shard verified): "
              f"{counted(report['samples'], 'sample')} in {counted(report['shards'], 'shard')}"
              + (f" ({counted(skipped, 'unreadable input')} skipped when it was written, listed in report.json)"
                 if skipped else "")
              + "; nothing written (to write it again with other options or input, pass --overwrite)")
    else:
        _print_written(report, lost)
    folder, pattern = report.get("read_as") or reads_all(report["out"], args.pattern, report["shards"])
    print(redact_text(f"{'it holds' if done else 'wrote'} "
                      f"{counted(report['samples'], 'sample')} in {counted(report['shards'], 'shard')}: "
                      f"read them all as {folder} "
                      f"or {pattern}"))
    return 0


def _print_written(report: dict, lost: int) -> None:
    print(f"{report['out']}: {counted(report['samples'], 'sample')} in {counted(report['shards'], 'shard')}, "
          f"{report['bytes'] / 1e6:.1f} MB, {report['num_skipped']} skipped "
          + (f"(input items listed in report.json) and {counted(lost, 'sample')} never read after the cut of a "
             "truncated input tar " if lost else "") +
          f"({report['samples_per_s']} samples/s, {report['mb_per_s']} MB/s)")
