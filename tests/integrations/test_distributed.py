"""loaders.DataLoader under 2-process CPU (gloo) runs: HF Accelerate's prepare() and Lightning's DDP.

Each launch is one ``torchrun --standalone --nproc_per_node 2`` of a helper script beside this file
(bounded by a timeout), shared by the tests of its module-scoped fixture.
"""
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from tests.shards import write_shards

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 120
SHARDS = [8, 8, 8, 6]  # 30 samples: 15 per rank, a short last batch of 4


def key_id(key: str) -> int:
    shard, i = key[1:].split("-")
    return int(shard) * 1000 + int(i)


def launch(script: str, out, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, script), *args]
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} did not finish within {TIMEOUT_S} s:\n{(e.stderr or b'')[-3000:]}")
    with open(os.path.join(out, "launch.log"), "w") as f:
        f.write(r.stdout + "\n" + r.stderr)
    assert r.returncode == 0, f"{script} failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-8000:]}"


def results(out, name):
    ranks = [json.load(open(os.path.join(out, f"{name}-{r}.json"))) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    return ranks


def reads(out, scenario):
    """Keys read per reading process (main processes and workers), from the helper's Reads wrapper."""
    files = sorted(f for f in os.listdir(out) if f.startswith(f"reads-{scenario}-rank"))
    return {f.split("-rank")[1]: [key_id(k) for k in open(os.path.join(out, f)).read().split()] for f in files}


# ---- Accelerate ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def acc(tmp_path_factory):
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e .[test])")
    out = tmp_path_factory.mktemp("accelerate")
    urls, samples = write_shards(out / "data", SHARDS)
    (out / "urls.json").write_text(json.dumps(urls))
    launch("dist_accelerate.py", out, str(out / "urls.json"), str(out))
    return str(out), sorted(key_id(s["__key__"]) for s in samples), results(out, "accelerate")


def test_accelerate_shards_a_map_style_loader_across_processes(acc):
    _, _, (r0, r1) = acc
    assert r0["types"]["map_even"] == "DataLoaderShard"
    a, b = r0["map_even"], r1["map_even"]  # 12 samples, batch 2, shuffle=True: 3 batches each
    assert len(a) == len(b) == 6 and not set(a) & set(b)
    assert sorted(a + b) == list(range(12))
    assert a != sorted(a) or b != sorted(b)  # shuffled, with one order shared by both processes


def test_accelerate_uneven_end_repeats_the_first_batch(acc):
    _, _, (r0, r1) = acc
    # 10 samples, batch 2 = 5 batches: even_batches=True (default) gives process 1 the first batch again
    assert r0["map_uneven"] == [0, 1, 4, 5, 8, 9]
    assert r1["map_uneven"] == [2, 3, 6, 7, 0, 1]


def test_shardstream_own_rank_split_unprepared_reads_each_sample_once(acc):
    out, every, (r0, r1) = acc
    a, b = r0["stream_own_split"], r1["stream_own_split"]
    assert r0["types"]["stream_own_split"] == "DataLoader"  # ours, with device=accelerator.device
    assert len(a) == len(b) == 15 and not set(a) & set(b) and sorted(a + b) == every
    read = reads(out, "stream_own_split")
    assert len(read) == 2 and sorted(sum(read.values(), [])) == every  # each rank read its half only


def test_shardstream_world1_with_default_dispatch_reads_each_sample_once(acc):
    out, every, (r0, r1) = acc
    assert r0["types"]["stream_dispatch"] == "DataLoaderDispatcher"
    a, b = r0["stream_dispatch"], r1["stream_dispatch"]
    assert not set(a) & set(b) and sorted(a + b) == every
    read = reads(out, "stream_dispatch")
    assert read and all(k.startswith("0-") for k in read)  # process 0 reads, then sends the slices
    assert sorted(sum(read.values(), [])) == every


def test_dispatch_with_workers_has_other_processes_prefetch_and_discard(acc):
    out, every, (r0, r1) = acc
    a, b = r0["stream_dispatch_worker"], r1["stream_dispatch_worker"]
    assert not set(a) & set(b) and sorted(a + b) == every  # delivered: still each sample once
    read = reads(out, "stream_dispatch_worker")
    main = sum((v for k, v in read.items() if k.startswith("0-")), [])
    other = sum((v for k, v in read.items() if k.startswith("1-")), [])
    assert sorted(main) == every
    # Accelerate makes the iterator on every process: process 1's worker may prefetch batches it never uses (how many
    # depends on how soon it starts: none at all on a loaded 2-core machine, as one CI run saw); never anything else
    assert set(other) <= set(every)


def test_shardstream_own_split_under_dispatch_loses_half(acc):
    out, every, (r0, r1) = acc
    delivered = set(r0["stream_split_and_dispatch"]) | set(r1["stream_split_and_dispatch"])
    read = sum(reads(out, "stream_split_and_dispatch").values(), [])
    assert len(read) == 15 and delivered == set(read) and len(delivered) < len(every)


def test_no_dispatch_makes_every_process_read_everything(acc):
    out, every, (r0, r1) = acc
    assert r0["types"]["stream_no_dispatch"] == "DataLoaderShard"
    a, b = r0["stream_no_dispatch"], r1["stream_no_dispatch"]
    assert set(a) | set(b) == set(every)
    # the last 6 samples are completed to a batch of 4 per process with the first ones: 32 delivered
    assert len(a) + len(b) == 32 and Counter(a + b) - Counter(every) == Counter({0: 1, 1: 1})
    read = reads(out, "stream_no_dispatch")
    assert len(read) == 2 and all(sorted(v) == every for v in read.values())


# ---- Lightning ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install -e .[test])")
    out = tmp_path_factory.mktemp("lightning")
    launch("dist_lightning.py", out, str(out))
    return results(out, "lightning")


def test_lightning_ddp_gives_each_rank_a_disjoint_half(ddp):
    a, b = (r["seen"] for r in ddp)
    assert len(a) == len(b) == 6 and not set(a) & set(b) and sorted(a + b) == list(range(12))


def test_lightning_recreates_our_loader_with_our_arguments(ddp):
    for r in ddp:
        assert r["loader"] == {"type": "loaders.dataloader.loader.DataLoader", "ours": True,
                               "sampler": "DistributedSampler", "seed": 3, "prefetch_depth": 3,
                               "has_stats": True}
