"""DDP on CPU: gloo ranks in separate processes, each reading ShardStream through a torch DataLoader
with rank / world size taken from torch.distributed. Every rank takes the same number of steps (an
all_reduce per step would hang otherwise) and the union of what they read is every sample."""
import datetime
import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from datapipe import ShardStream
from tests.shards import write_shards


def _keys(batch):
    return [s["__key__"] for s in batch]


def _rank_main(rank, world, init_file, urls, out, batch_size, num_workers):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        stream = ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=3)
        loader = torch.utils.data.DataLoader(stream, batch_size=batch_size, num_workers=num_workers, collate_fn=_keys)
        steps, keys = 0, []
        for batch in loader:
            total = torch.tensor([len(batch)], dtype=torch.int64)
            dist.all_reduce(total)  # hangs (until the gloo timeout) if a rank ran out of batches early
            keys += batch
            steps += 1
        everything = [None] * world
        dist.all_gather_object(everything, {"steps": steps, "keys": keys, "len": len(stream),
                                            "rank_world": stream._rank_world()})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(everything, f)
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path, world, urls, *, batch_size, num_workers):
    out = str(tmp_path / "out.json")
    ctx = mp.start_processes(_rank_main, args=(world, str(tmp_path / "init"), urls, out, batch_size, num_workers),
                             nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + 60
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "ranks did not finish: a collective hung"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,counts,batch_size,num_workers", [
    (3, [50, 1, 7, 23], 4, 2),  # uneven shards, DataLoader workers
    (4, [2, 1], 1, 0),          # fewer shards than ranks
    (2, [5, 0, 9], 3, 1),       # an empty shard, a last partial batch
])
def test_every_rank_same_steps_and_every_sample_once(tmp_path, world, counts, batch_size, num_workers):
    urls, samples = write_shards(tmp_path / "data", counts)
    ranks = run_ranks(tmp_path, world, urls, batch_size=batch_size, num_workers=num_workers)
    assert [r["rank_world"] for r in ranks] == [[i, world] for i in range(world)]
    assert len({r["steps"] for r in ranks}) == 1, [r["steps"] for r in ranks]
    assert len({len(r["keys"]) for r in ranks}) == 1 and ranks[0]["len"] == len(ranks[0]["keys"])
    union = [k for r in ranks for k in r["keys"]]
    assert set(union) == {s["__key__"] for s in samples}
    assert len(union) - len(samples) < world  # at most world - 1 repeats to even the ranks out
