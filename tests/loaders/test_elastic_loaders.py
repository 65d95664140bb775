"""Elastic resume through loaders.DataLoader: a checkpoint of 4 ranks x 2 workers resumes on any shape."""
import collections
import random

import pytest

from datapipe import ShardStream
from datapipe.order import elastic
from loaders import DataLoader
from tests.shards import write_shards

SHAPES = [(2, 3), (3, 1), (1, 4), (8, 1)]


def keys(batch):
    return [s["__key__"] for s in batch]


def _loader(urls, rank, world, workers, **kw):
    stream = ShardStream(urls, shuffle=True, seed=5, shuffle_buffer=kw.pop("shuffle_buffer", 4), rank=rank,
                         world_size=world)
    return DataLoader(stream, batch_size=2, num_workers=workers, collate_fn=keys, **kw)


def _run(loader, k=None, state=None):
    """Keys of the first ``k`` batches (all without ``k``), the batch count and the loader's state after them."""
    if state is not None:
        loader.load_state_dict(state)
    got, n = [], 0
    it = iter(loader)
    for batch in it:
        got += batch
        n += 1
        if k is not None and n == k:
            break
    st = loader.state_dict()
    it.close()
    return got, n, st


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """4 ranks x 2 workers, each stopped after a random number of batches (the same on every rank)."""
    d = tmp_path_factory.mktemp("elastic_loaders")
    urls, samples = write_shards(str(d), [7, 0, 11, 5, 9, 13, 3])  # 48 samples
    k = random.Random("loaders-elastic").randint(1, 4)
    before, states = [], []
    for r in range(4):
        got, n, st = _run(_loader(urls, r, 4, 2), k)
        assert n == k
        before += got
        states.append(st)
    return urls, sorted(s["__key__"] for s in samples), before, states


def _check_union(before, after, everything, old_world, new_world):
    seen = collections.Counter(before + after)
    assert set(seen) == set(everything)
    assert sum(n - 1 for n in seen.values()) <= (old_world - 1) + (new_world - 1)


@pytest.mark.parametrize("new", SHAPES)
def test_dataloader_resumes_on_another_shape(checkpoint, new):
    urls, everything, before, states = checkpoint
    world, workers = new
    g = elastic.merge_states(states)
    assert elastic.shape(g) == {"world_size": 4, "num_workers": 2}
    after, batches = [], []
    for r in range(world):
        got, n, _ = _run(_loader(urls, r, world, workers), state=g if r % 2 else states)  # global or list
        after += got
        batches.append(n)
    _check_union(before, after, everything, 4, world)
    assert len(set(batches)) == 1, batches  # equal batch counts per rank: DDP does not hang
    again, _, _ = _run(_loader(urls, 0, world, workers), state=g)
    assert again == after[:len(again)]  # deterministic given the checkpoint and the new shape


def test_dataloader_state_keeps_the_shape_and_plan_basis(checkpoint):
    urls, everything, before, states = checkpoint
    ds = states[1]["dataset"]
    assert (ds["rank"], ds["world_size"], ds["num_workers"], ds["seed"], ds["shuffle_buffer"]) == (1, 4, 2, 5, 4)
    assert ds["total"] == len(everything)
    # a reshaped run's state carries its generation and base, so it reshapes again
    middle, mids = [], []
    for r in range(3):
        got, _, st = _run(_loader(urls, r, 3, 2), 1, state=states)
        middle += got
        mids.append(st)
    assert all(s["dataset"]["generation"] == 1 and s["dataset"]["base"] for s in mids)
    after = []
    for r in range(2):
        after += _run(_loader(urls, r, 2, 1), state=mids)[0]
    seen = collections.Counter(before + middle + after)
    assert set(seen) == set(everything) and sum(seen.values()) - len(everything) <= 3 + 2 + 1


def test_same_shape_global_state_is_bit_exact(checkpoint):
    urls, _, _, states = checkpoint
    k = states[2]["batches"]
    full, _, _ = _run(_loader(urls, 2, 4, 2))
    got, _, _ = _run(_loader(urls, 2, 4, 2), state=elastic.merge_states(states))
    assert full[2 * k:] == got


def test_own_rank_state_on_another_worker_count_is_refused(checkpoint):
    urls, _, _, states = checkpoint
    with pytest.raises(ValueError, match="global"):
        _loader(urls, 1, 4, 3).load_state_dict(states[1])


def test_global_state_dict_without_distributed(tmp_path):
    urls, samples = write_shards(str(tmp_path), [6, 9, 5])
    loader = _loader(urls, 0, 1, 2)
    head, _, _ = _run(loader, 3)
    g = loader.global_state_dict()  # one process is the whole job
    assert elastic.is_global(g) and elastic.shape(g) == {"world_size": 1, "num_workers": 2}
    resumed = _loader(urls, 0, 1, 3)
    resumed.load_state_dict(g)
    assert resumed.state_dict() == g  # loaded, nothing handed out since: the same global state
    assert resumed.global_state_dict() == g
    rest, _, _ = _run(resumed)
    assert sorted(head + rest) == sorted(s["__key__"] for s in samples)
    # a single rank's own state resumes on another worker count too (it is the whole job)
    resumed = _loader(urls, 0, 1, 0)
    rest, _, _ = _run(resumed, state=loader.state_dict())
    assert sorted(head + rest) == sorted(s["__key__"] for s in samples)
    # a rank of a bigger job cannot gather alone
    with pytest.raises(ValueError, match="missing"):
        _loader(urls, 1, 2, 1).global_state_dict()


def test_global_state_before_any_batch_starts_the_epoch(tmp_path):
    urls, samples = write_shards(str(tmp_path), [6, 9])
    g = elastic.merge_states([{**_loader(urls, r, 2, 1).state_dict(), "rank": r, "world_size": 2} for r in range(2)])
    got = []
    for r in range(3):
        got += _run(_loader(urls, r, 3, 2), state=g)[0]
    _check_union([], got, [s["__key__"] for s in samples], 1, 3)


# ---- torchrun (gloo): a collective global_state_dict on 2 ranks, resumed on 3 ---------------------
def _child(cfg_path):
    """One rank under torchrun: ``cfg``: urls, workers, log (``%d`` for the rank), ckpt, stop_after / resume."""
    import json
    import os

    import torch
    import torch.distributed as dist

    with open(cfg_path) as f:
        cfg = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stream = ShardStream(cfg["urls"], shuffle=True, seed=5, shuffle_buffer=4)  # rank / world from torch
    loader = DataLoader(stream, batch_size=2, num_workers=cfg["workers"], collate_fn=keys)
    if cfg.get("resume"):
        loader.load_state_dict(torch.load(cfg["resume"], weights_only=False))
    n = 0
    with open(cfg["log"] % rank, "w") as log:
        for batch in loader:
            log.write("".join(k + "\n" for k in batch))
            n += 1
            if n == cfg.get("stop_after"):
                g = loader.global_state_dict()  # collective
                if rank == 0:
                    torch.save(g, cfg["ckpt"] + ".tmp")
                    os.replace(cfg["ckpt"] + ".tmp", cfg["ckpt"])
                break
        log.write("DONE\n")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_torchrun_gloo_global_state_on_2_resumes_on_3(tmp_path):
    import json
    import os
    import subprocess
    import sys

    import torch

    urls, samples = write_shards(str(tmp_path / "d"), [9, 12, 7, 10, 8])  # 46 samples
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    ckpt = str(tmp_path / "global.pt")

    def run(name, procs, cfg):
        path = str(tmp_path / f"{name}.json")
        with open(path, "w") as f:
            json.dump({"urls": urls, "ckpt": ckpt, "log": str(tmp_path / (name + "%d.log")), **cfg}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node",
               str(procs), os.path.abspath(__file__), path]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
        out = []
        for r in range(procs):
            with open(tmp_path / f"{name}{r}.log") as f:
                lines = f.read().split("\n")[:-1]
            assert lines[-1] == "DONE"
            out.append(lines[:-1])
        return out

    before = run("save", 2, {"workers": 1, "stop_after": 3})
    g = torch.load(ckpt, weights_only=False)
    assert elastic.shape(g) == {"world_size": 2, "num_workers": 1}
    after = run("resume", 3, {"workers": 2, "resume": ckpt})
    assert len({len(a) for a in after}) == 1
    _check_union([k for b in before for k in b], [k for a in after for k in a], [s["__key__"] for s in samples], 2, 3)


if __name__ == "__main__":
    import sys

    _child(sys.argv[1])
