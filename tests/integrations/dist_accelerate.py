"""Launched by test_distributed.py under torchrun (2 CPU processes, gloo): what each process gets
from ``Accelerator(cpu=True)`` with ``loaders.DataLoader`` over a map-style dataset and over a
``ShardStream``. Writes ``<out>/accelerate-<rank>.json`` (sample ids per scenario) and, for the
stream scenarios, one file per reading process listing the sample keys it read."""
import json
import os
import sys

import torch
from torch.utils.data import IterableDataset, TensorDataset

from accelerate import Accelerator, DataLoaderConfiguration
from datapipe import ShardStream
from loaders import DataLoader


def key_id(key: str) -> int:
    """``s<shard>-<i>`` (tests/datapipe/conftest.py's keys) -> shard * 1000 + i."""
    shard, i = key[1:].split("-")
    return int(shard) * 1000 + int(i)


def collate_ids(samples):
    return torch.tensor([key_id(s["__key__"]) for s in samples])


class Reads(IterableDataset):
    """Passes a stream through, appending every key it reads to ``<prefix>-<pid>`` (one file per
    reading process, workers included)."""

    def __init__(self, inner, prefix):
        self.inner, self.prefix = inner, prefix

    def __iter__(self):
        with open(f"{self.prefix}-{os.getpid()}", "a") as f:
            for s in self.inner:
                f.write(s["__key__"] + "\n")
                f.flush()
                yield s


def ids(loader):
    out = []
    for batch in loader:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        out += x.reshape(-1).long().tolist()
    return out


def main(urls_file, out):
    urls = json.load(open(urls_file))
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    got = {"world_size": acc.num_processes, "types": {}}

    def run(name, loader):
        got[name] = ids(loader)
        got["types"][name] = type(loader).__name__

    def reads(name):
        return os.path.join(out, f"reads-{name}-rank{rank}")

    # map-style: Accelerate re-creates the loader with a BatchSamplerShard (shuffle synchronised)
    run("map_even", acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True)))
    run("map_uneven", acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2)))
    # ShardStream splits by rank itself (torch.distributed is initialised): not prepared
    stream = Reads(ShardStream(urls), reads("stream_own_split"))
    run("stream_own_split", DataLoader(stream, batch_size=4, collate_fn=collate_ids, device=acc.device))
    # one global stream (rank=0, world_size=1), prepared: Accelerate's default dispatch_batches=True
    stream = Reads(ShardStream(urls, rank=0, world_size=1), reads("stream_dispatch"))
    run("stream_dispatch", acc.prepare(DataLoader(stream, batch_size=4, collate_fn=collate_ids)))
    # the same with a worker: torch >= 2.0.1 Accelerate makes the iterator on every process
    stream = Reads(ShardStream(urls, rank=0, world_size=1), reads("stream_dispatch_worker"))
    run("stream_dispatch_worker", acc.prepare(DataLoader(stream, batch_size=4, collate_fn=collate_ids, num_workers=1)))
    # the trap: ShardStream's own split under Accelerate's dispatch (process 0 reads only its half)
    stream = Reads(ShardStream(urls), reads("stream_split_and_dispatch"))
    run("stream_split_and_dispatch", acc.prepare(DataLoader(stream, batch_size=4, collate_fn=collate_ids)))
    # dispatch_batches=False: every process reads the whole stream and keeps its slice of each batch
    acc2 = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    stream = Reads(ShardStream(urls, rank=0, world_size=1), reads("stream_no_dispatch"))
    run("stream_no_dispatch", acc2.prepare(DataLoader(stream, batch_size=4, collate_fn=collate_ids)))

    with open(os.path.join(out, f"accelerate-{rank}.json"), "w") as f:
        json.dump(got, f)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
