"""The peers benchmark's writers: the same image folder in each system's own format, written with its own writer.

:data:`FORMATS` says, per system, what is written and by which API (every result row carries it). SPDL has no
format of its own: it reads the image files where they are.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time

from datapipe.tools.bench.peer_readers import SYSTEMS, list_images, read_item

FORMATS = {
    "torch": "loose files (a copy of the folder, shutil.copytree)",
    "spdl": "loose files (the source folder itself: SPDL has no format of its own)",
    "webdataset": "WebDataset tars (webdataset.ShardWriter)",
    "datapipe": "WebDataset tars + manifest (datapipe shard, shuffled)",
    "litdata": "litdata chunks (litdata.optimize)",
    "mosaicml": "MDS shards (streaming.MDSWriter)",
    "grain": "ArrayRecord files of pickled samples (array_record ArrayRecordWriter, group_size:1)",
    "energon": "WebDataset tars (webdataset.ShardWriter) + `energon prepare` (ImageClassificationSample)",
}
SHARD_SAMPLES = 10_000  # samples per tar / ArrayRecord file where the writer takes a count


def _wds_write(items, out: str) -> None:
    import webdataset as wds

    os.makedirs(out)
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=1 << 30, maxcount=SHARD_SAMPLES,
                         verbose=0) as sink:
        for item in items:
            s = read_item(item)
            sink.write({"__key__": s["key"].replace("/", "_"), "jpg": s["image"], "cls": str(s["cls"]).encode()})


def _energon_prepare(out: str, *, workers: int) -> None:
    """``energon prepare`` (its command line) on WebDataset tars: one train split, images and labels mapped."""
    cmd = [sys.executable, "-c", "import sys; from megatron.energon.cli.main import main; sys.exit(main())",
           "prepare", out, "--non-interactive", "--no-progress", "--split-ratio", "1,0,0",
           "--sample-type", "ImageClassificationSample", "--field-map", '{"image": "jpg", "label": "cls"}',
           "--num-workers", str(max(1, workers))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"energon prepare exited {done.returncode}: {tail[0][:300]}")


def _grain_write(items, out: str) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(out)
    for start in range(0, len(items), SHARD_SAMPLES):
        writer = ArrayRecordWriter(os.path.join(out, f"part-{start // SHARD_SAMPLES:05d}.array_record"),
                                   "group_size:1")
        try:
            for item in items[start:start + SHARD_SAMPLES]:
                writer.write(pickle.dumps(read_item(item), protocol=pickle.HIGHEST_PROTOCOL))
        finally:
            writer.close()


def write(system: str, source: str, out: str, *, workers: int) -> dict:
    """Write ``source`` in ``system``'s native format into ``out`` (which must not exist).

    Returns images, seconds, images/s and bytes written (SPDL: ``None`` figures, it reads ``source`` as it is).
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")
    items = list_images(source)
    if system == "spdl":
        return {"images": len(items), "seconds": None, "images_per_s": None, "bytes": None, "format": FORMATS[system]}
    t0 = time.perf_counter()
    if system == "torch":
        shutil.copytree(source, out)
    elif system == "webdataset":
        _wds_write(items, out)
    elif system == "energon":
        _wds_write(items, out)
        _energon_prepare(out, workers=workers)
    elif system == "datapipe":
        from datapipe.jobs.shard.job import shard
        from datapipe.jobs.shard.options import ShardOptions

        # the job's own function (not the CLI, which dispatches to the tools: no import circle)
        shard(source, out, ShardOptions(shuffle=True), workers=max(1, workers), progress=False)  # classes mixed
    elif system == "litdata":
        from litdata import optimize

        optimize(fn=read_item, inputs=items, output_dir=out, chunk_bytes="64MB", num_workers=max(1, workers),
                 verbose=False)
    elif system == "mosaicml":
        from streaming import MDSWriter

        with MDSWriter(out=out, columns={"key": "str", "image": "bytes", "cls": "int"}) as sink:
            for item in items:
                sink.write(read_item(item))
    elif system == "grain":
        _grain_write(items, out)
    seconds = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {"images": len(items), "seconds": round(seconds, 3), "images_per_s": round(len(items) / seconds, 1),
            "bytes": size, "format": FORMATS[system]}
