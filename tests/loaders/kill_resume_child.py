"""Child process of tests/loaders/test_kill_resume.py: iterate a loader, log every batch, checkpoint after each.

``python kill_resume_child.py CONFIG.json``. CONFIG: ``case`` (which loader), ``urls`` (or ``urls_a`` /
``urls_b`` for the mix), ``log`` (one line per batch, flushed before the checkpoint), ``ckpt`` (written
atomically after each batch: ``{"batches": n, "state": loader.state_dict()}``, ``n`` = batches the
state covers), ``resume`` (load ``ckpt`` first and log only the rest), ``pause`` (seconds slept after
logging a batch and again after checkpointing it, so the parent can kill at either point).
A finished run writes ``DONE`` as the last log line.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time


def keys(samples):
    return [s["__key__"] for s in samples]


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        t = t.contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def build(cfg):
    """``(loader, line)``: the case's loader and how one of its batches becomes a log line."""
    case = cfg["case"]
    if case == "dataloader":
        from datapipe import ShardStream
        from loaders import DataLoader

        stream = ShardStream(cfg["urls"], shuffle=True, shuffle_buffer=5, seed=3, rank=0, world_size=1)
        return DataLoader(stream, batch_size=3, num_workers=2, collate_fn=keys), json.dumps
    if case == "mix":
        from datapipe import ShardStream, mix
        from loaders import DataLoader

        a = ShardStream(cfg["urls_a"], shuffle=True, shuffle_buffer=4, seed=1, rank=0, world_size=1)
        b = ShardStream(cfg["urls_b"], shuffle=True, seed=2, rank=0, world_size=1)
        mixed = mix([a, b], weights=[2, 1], seed=7, stop="all")
        return DataLoader(mixed, batch_size=3, num_workers=2, collate_fn=keys), json.dumps
    if case == "tokens":
        from loaders import TokenLoader

        from datapipe import ShardStream
        from loaders.tokens.options import PackOptions

        loader = TokenLoader(ShardStream(cfg["urls"], shuffle=True, shuffle_buffer=8, seed=4), seq_len=64, batch_size=2,
                             packing=PackOptions(buffer_size=16))
        return loader, lambda b: json.dumps({k: digest([v]) if hasattr(v, "numpy") else repr(v)
                                             for k, v in sorted(b.items())})
    if case in ("images", "images_workers"):
        from datapipe import ShardStream
        from loaders.images.loader import ImageLoader
        from loaders.images.options import DecodeOptions, ReadOptions

        loader = ImageLoader(ShardStream(cfg["urls"], shuffle=True, shuffle_buffer=6, seed=9), batch_size=4,
                             image_size=16, device="cpu", train=False, decode=DecodeOptions(num_threads=1),
                             read=ReadOptions(label_key="__key__", label_decoder=int,
                                              read_workers=2 if case == "images_workers" else 0))
        return loader, lambda b: json.dumps({"labels": b[1].tolist(), "images": digest([b[0]])})
    raise ValueError(f"unknown case {case!r}")


def main(path: str) -> None:
    import torch

    with open(path) as f:
        cfg = json.load(f)
    loader, line = build(cfg)
    done = 0
    if cfg["resume"]:
        saved = torch.load(cfg["ckpt"], weights_only=False)
        loader.load_state_dict(saved["state"])
        done = saved["batches"]
    pause = float(cfg.get("pause", 0.0))
    tmp = cfg["ckpt"] + ".tmp"
    with open(cfg["log"], "a") as log:
        for batch in loader:
            log.write(line(batch) + "\n")
            log.flush()
            done += 1
            time.sleep(pause)
            if not cfg["resume"]:
                torch.save({"batches": done, "state": loader.state_dict()}, tmp)
                os.replace(tmp, cfg["ckpt"])
            time.sleep(pause)
        log.write("DONE\n")
    close = getattr(loader, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    main(sys.argv[1])
