"""Child process of tests/datapipe/order/test_elastic.py: one rank of a job reading a ShardStream.

``python elastic_child.py CONFIG.json``. CONFIG: ``urls``, ``rank`` / ``world`` (or ``torchrun``: take
them from torch.distributed, gloo), ``workers`` (DataLoader worker processes), ``log`` (one sample key a
line, flushed before the checkpoint), ``ckpt`` (this rank's state, written atomically after every
sample: ``{"samples": n, "state": ...}``), ``resume`` (a list of checkpoint files of all ranks, or one
global state file, to load first), ``stop_after`` (samples, then save the gathered global state to
``ckpt`` on rank 0 and exit; torchrun only), ``pause`` (seconds slept per sample).
A finished run writes ``DONE`` as the last log line.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(path: str) -> None:
    import torch
    import torch.distributed as dist

    from datapipe import ShardStream
    from datapipe.order import elastic

    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("torchrun"):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg["log"] = cfg["log"] % rank
    else:
        rank, world = cfg["rank"], cfg["world"]
    stream = ShardStream(cfg["urls"], shuffle=True, shuffle_buffer=4, seed=11, rank=rank, world_size=world)
    if cfg.get("resume"):
        files = cfg["resume"]
        saved = [torch.load(p, weights_only=False) for p in files]
        stream.load_state_dict(saved[0] if len(saved) == 1 and elastic.is_global(saved[0])
                               else [s["state"] for s in saved])
    workers = int(cfg.get("workers", 0))

    def tag(sample):
        info = torch.utils.data.get_worker_info()
        return sample["__key__"], (info.dataset.state_dict() if info is not None else None)

    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=tag)
    positions, last, done = {}, None, 0
    tmp = cfg["ckpt"] + ".tmp"
    pause = float(cfg.get("pause", 0.0))
    with open(cfg["log"], "a") as log:
        for key, st in loader:
            log.write(key + "\n")
            log.flush()
            done += 1
            if st is not None:
                positions.update(st["workers"])
                last = st
            if workers == 0:
                state = stream.state_dict()
            else:
                state = {**last, "workers": dict(positions), "num_workers": workers,
                         "first_worker": (list(last["workers"])[0] + 1) % workers}
            if cfg.get("stop_after") is not None and done == cfg["stop_after"]:
                merged = elastic.gather_state(state)
                if rank == 0:
                    torch.save(merged, cfg["ckpt"])
                break
            if not cfg.get("torchrun"):
                torch.save({"samples": done, "state": state}, tmp)
                os.replace(tmp, cfg["ckpt"])
            time.sleep(pause)
        else:
            log.write("DONE\n")
    del loader
    if cfg.get("torchrun"):
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
