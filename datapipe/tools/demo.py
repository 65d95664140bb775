"""``datapipe demo``: the main job end to end on a fresh machine.

Makes a small real dataset (ImageNet-like JPEG photographs in WebDataset shards, plus token
shards from real text), streams it through the library's loaders and prints throughput:
ShardStream (raw samples), loaders.DataLoader (workers + collate), loaders.ImageLoader (DALI
decode + augment; CPU operators without a GPU) and loaders.TokenLoader (packed LLM batches). The table
has one unit per column (batches, samples, seconds, samples/s, tokens/s); its last lines say what to try next.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

from datapipe.storage.urls import redact_text
from datapipe.words import counted

log = logging.getLogger("datapipe.demo")  # the CLI lives in datapipe; the demo needs the loaders


def _timed(name: str, iterable, samples, *, batched: bool = True, tokens=None) -> dict:
    """One stage timed: ``batches`` (None for a stage that yields samples), ``samples`` (``samples(item)`` each)
    and, with ``tokens``, the real tokens (``tokens(item)``)."""
    start = time.perf_counter()
    batches = count = n_tokens = 0
    for item in iterable:
        batches += 1
        count += samples(item)
        if tokens is not None:
            n_tokens += tokens(item)
    secs = time.perf_counter() - start
    return {"stage": name, "batches": batches if batched else None, "samples": count, "seconds": secs,
            "tokens": n_tokens if tokens is not None else None}


def stage_stream(shards: list[str]) -> dict:
    from datapipe import ShardStream

    stream = ShardStream(shards, shuffle=True, shuffle_buffer=500, seed=0)
    row = _timed("ShardStream (raw samples)", stream, lambda s: 1, batched=False)
    row["note"] = "yields samples, not batches"
    return row


def _collate_jpeg_sizes(samples):
    import torch

    return {"bytes": torch.tensor([len(s["jpg"]) for s in samples]),
            "label": torch.tensor([int(s["cls"]) for s in samples])}


def stage_dataloader(shards: list[str], workers: int) -> dict:
    from datapipe import ShardStream
    from loaders import DataLoader

    loader = DataLoader(ShardStream(shards, shuffle=True, shuffle_buffer=500), batch_size=64,
                        num_workers=workers, collate_fn=_collate_jpeg_sizes)
    row = _timed(f"loaders.DataLoader ({workers} workers)", loader, lambda b: len(b["label"]))
    stats = loader.stats()
    row["note"] = f"consumer waited {stats['wait_fraction']:.0%} of the time (the demo has no training step)"
    return row


def stage_images(shards: list[str], device: str) -> dict:
    from loaders import ImageLoader

    loader = ImageLoader(shards, batch_size=64, image_size=224, train=True, device=device)
    row = _timed(f"loaders.ImageLoader (DALI, {device})", loader, lambda b: b[0].shape[0])
    row["note"] = "decoded, cropped to 224, flipped, normalised; the last partial batch dropped"
    return row


def stage_tokens(token_shards: list[str], device: str | None) -> dict:
    from loaders import TokenLoader

    loader = TokenLoader(token_shards, seq_len=2048, batch_size=8, device=device)
    row = _timed("loaders.TokenLoader (packed, 2048)", loader, lambda b: int(b["input_ids"].shape[0]),
                 tokens=lambda b: int((b["labels"] != -100).sum()))
    stats = loader.stats()
    row["note"] = f"a sample is a packed row of 2048 tokens; packing efficiency {stats.get('efficiency', 0):.1%}"
    return row


COLUMNS = ("stage", "batches", "samples", "seconds", "samples/s", "tokens/s", "note")


def table(rows: list[dict]) -> list[str]:
    """The demo's table, one unit per column: batches, samples, seconds, samples/s, tokens/s ("-": not counted)."""
    def rate(n, secs):
        return f"{n / secs:,.0f}" if n is not None and secs > 0 else "-"

    lines = [f"{COLUMNS[0]:38s} {COLUMNS[1]:>8s} {COLUMNS[2]:>8s} {COLUMNS[3]:>8s} {COLUMNS[4]:>10s} "
             f"{COLUMNS[5]:>11s}  {COLUMNS[6]}"]
    for r in rows:
        batches = "-" if r["batches"] is None else f"{r['batches']:,d}"
        lines.append(f"{r['stage']:38s} {batches:>8s} {r['samples']:>8,d} {r['seconds']:>8.2f} "
                     f"{rate(r['samples'], r['seconds']):>10s} {rate(r['tokens'], r['seconds']):>11s}  "
                     f"{r.get('note', '')}".rstrip())
    return lines


def next_steps(data_dir: str, device: str = "cpu") -> list[str]:
    """What to try after the demo: the README's commands, on the demo's data and on your own."""
    images = os.path.join(data_dir, "images")
    steps = [
        (f"datapipe inspect {images}", "what the demo's shards hold"),
        (f"datapipe bench loader {images} --device {device}", "torch, webdataset, DALI and datapipe side by side"),
        ("datapipe shard photos/ shards/", "your images, one sub-folder per class -> shards"),
        ("datapipe bench storage shards/", "how fast your storage serves them"),
        ("datapipe doctor -- python train.py", "does your training wait for data, and what to change"),
    ]
    width = max(len(command) for command, _ in steps)
    return ["", "Next (README.md, 'Usage', has the Python side):"] + [
        f"  {command:{width}s}  # {what}" for command, what in steps]


def make_token_shards(out_dir: str, *, max_docs: int = 3000) -> list[str]:
    """Token shards from real text: the Python sources of numpy and torch, byte-level token ids (npy)."""
    import glob
    import io

    import numpy as np

    from datapipe import ShardWriter
    from datapipe.tar.manifest import read_manifest

    if read_manifest(out_dir) is None:
        import numpy

        root = os.path.dirname(numpy.__file__)
        files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))[:max_docs]
        with ShardWriter(os.path.join(out_dir, "shard-%06d.tar"), max_count=500) as writer:
            for i, path in enumerate(files):
                with open(path, "rb") as f:
                    ids = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int32)
                if ids.size == 0:
                    continue
                buf = io.BytesIO()
                np.save(buf, ids)
                writer.write({"__key__": f"doc{i:06d}", "npy": buf.getvalue()})
    manifest = read_manifest(out_dir)
    return [os.path.join(out_dir, s["name"]) for s in manifest["shards"]]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="demo-data", help="where the demo datasets go (default ./demo-data)")
    parser.add_argument("--images", type=int, default=2000, help="images to make (default 2000)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")


def run_command(args: argparse.Namespace) -> int:
    import torch

    from datapipe.tar.manifest import read_manifest
    from datapipe.tools.synthetic import make_image_dataset

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    image_dir = os.path.join(args.data, "images")
    manifest = read_manifest(image_dir)
    if manifest is None or manifest["num_samples"] != args.images:
        log.info("making %d ImageNet-like JPEGs in %s", args.images, image_dir)
        make_image_dataset(image_dir, num_images=args.images, num_classes=100, shard_max_count=250,
                           num_workers=max(1, os.cpu_count() or 1))
        manifest = read_manifest(image_dir)
    shards = [os.path.join(image_dir, s["name"]) for s in manifest["shards"]]
    log.info("dataset: %s, %.1f MB in %s", counted(manifest["num_samples"], "image"), manifest["num_bytes"] / 1e6,
             counted(len(shards), "shard"))
    log.info("token documents: %s", os.path.join(args.data, "tokens"))
    token_shards = make_token_shards(os.path.join(args.data, "tokens"))

    stages = [
        ("stream", lambda: stage_stream(shards)),
        ("dataloader", lambda: stage_dataloader(shards, args.workers)),
        ("images", lambda: stage_images(shards, device)),
        ("tokens", lambda: stage_tokens(token_shards, device if device != "cpu" else None)),
    ]
    rows, failed = [], 0
    for name, run in stages:
        try:
            rows.append(run())
        except ImportError as e:
            log.warning("skipped the %s stage: %s (install the extra it needs)", name, redact_text(e))
        except Exception:
            log.exception("the %s stage failed", name)
            failed += 1
    for line in table(rows) + next_steps(args.data, device):
        print(line)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="datapipe demo", description=__doc__)
    configure_parser(parser)
    return run_command(parser.parse_args(argv))
