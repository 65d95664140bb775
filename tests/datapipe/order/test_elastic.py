"""Elastic resume: a checkpoint of N ranks x W workers resumes on M ranks x V workers, nothing lost."""
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from datapipe import ShardStream, mix
from datapipe.order import elastic
from datapipe.order.plan import normalize, run_ranges, subtract, take, worker_plan
from tests.shards import write_shards

SHAPES = [(2, 3), (3, 1), (1, 4), (8, 1)]


def _tag(sample):
    info = torch.utils.data.get_worker_info()
    if info is None:
        return sample, 0, None
    return sample, info.id, info.dataset.state_dict()


def _key(item):
    return item["__key__"] if isinstance(item, dict) else item


def run_rank(dataset, num_workers, k=None, state=None):
    """Items of one rank (at most ``k``) and its rank state, as a loader gathers it from its workers."""
    if state is not None:
        dataset.load_state_dict(state)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers, collate_fn=_tag)
    got, workers, last, first = [], {}, None, 0
    for i, (item, wid, st) in enumerate(loader):
        if k is not None and i == k:
            break
        got.append(_key(item))
        if st is not None:
            workers.update(st["workers"])
            last = st
            first = (list(st["workers"])[0] + 1) % max(1, num_workers)  # next logical worker (torch's round robin)
    del loader
    if num_workers == 0:
        return got, dataset.state_dict()
    rank_state = dict(last if last is not None else dataset.state_dict())
    rank_state.update(workers=workers, num_workers=num_workers, first_worker=first)
    return got, rank_state


@pytest.fixture
def urls(tmp_path):
    urls, _ = write_shards(str(tmp_path), [7, 0, 11, 5, 9, 13, 3])  # 48 samples
    return urls


def _stream(urls, rank, world, **kw):
    return ShardStream(urls, shuffle=True, seed=3, rank=rank, world_size=world, **kw)


def _all_keys(urls):
    return sorted(s["__key__"] for s in ShardStream(urls))


def _check_union(before, after, everything, old_world, new_world):
    seen = collections.Counter(before + after)
    assert set(seen) == set(everything)
    repeats = sum(n - 1 for n in seen.values())
    assert repeats <= (old_world - 1) + (new_world - 1), repeats


def checkpoint(urls, shape, k, **kw):
    world, nw = shape
    before, states = [], []
    for r in range(world):
        got, st = run_rank(_stream(urls, r, world, **kw), nw, k)
        before += got
        states.append(st)
    return before, states


def resume(urls, states, shape, **kw):
    world, nw = shape
    after, per_rank = [], []
    for r in range(world):
        got, _ = run_rank(_stream(urls, r, world, **kw), nw, state=states)
        after += got
        per_rank.append(len(got))
    return after, per_rank


# ---- plan over ranges ----------------------------------------------------------------------------
def test_ranges_plan_covers_base_once_with_equal_counts():
    rnd = random.Random(0)
    for _ in range(200):
        base = normalize((a, a + rnd.randint(1, 6)) for a in rnd.sample(range(100), rnd.randint(1, 8)))
        n = sum(b - a for a, b in base)
        world, nw = rnd.randint(1, 9), rnd.randint(1, 4)
        counts = collections.Counter()
        per_rank = []
        for rank in range(world):
            total = 0
            for w in range(nw):
                ranges, _ = run_ranges(base, rank=rank, world_size=world, worker=w, num_workers=nw)
                for a, b in ranges:
                    counts.update(range(a, b))
                    total += b - a
            per_rank.append(total)
        assert set(counts) == {x for a, b in base for x in range(a, b)}
        assert len(set(per_rank)) == 1 and sum(counts.values()) - n <= world - 1


def test_ranges_plan_maps_to_shard_segments():
    plan = worker_plan([3, 4, 5], [2, 0, 1], rank=0, world_size=1, worker=0, num_workers=1, base=[(1, 2), (4, 9)])
    # global numbers in order 2,0,1: shard 2 holds 0..4, shard 0 holds 5..7, shard 1 holds 8..11
    assert [(s.shard, s.start, s.stop) for s in plan.segments] == [(2, 1, 2), (2, 4, 5), (0, 0, 3), (1, 0, 1)]
    assert take([(0, 3), (10, 12)], 4, 3) == [(11, 12), (0, 2)]
    assert subtract([(0, 10)], [(3, 4), (6, 8)]) == [(0, 3), (4, 6), (8, 10)]


def test_merge_states_needs_every_rank(urls):
    _, states = checkpoint(urls, (2, 0), 3)
    with pytest.raises(ValueError, match="ranks \\[1\\] are missing"):
        elastic.merge_states(states[:1])
    g = elastic.merge_states(states[::-1])
    assert [s["rank"] for s in g["ranks"]] == [0, 1]
    assert elastic.shape(g) == {"world_size": 2, "num_workers": 1}
    with pytest.raises(ValueError, match="missing"):
        elastic.gather_state(states[1])  # without torch.distributed: this process must be the whole job


# ---- streams -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle_buffer", [0, 5])
@pytest.mark.parametrize("new", SHAPES)
def test_stream_resumes_on_another_shape(urls, shuffle_buffer, new):
    everything = _all_keys(urls)
    k = random.Random(hash(new) + shuffle_buffer).randint(1, 5)
    before, states = checkpoint(urls, (4, 2), k, shuffle_buffer=shuffle_buffer)
    assert len(before) == 4 * k
    g = elastic.merge_states(states)
    assert elastic.shape(g) == {"world_size": 4, "num_workers": 2}
    after, per_rank = resume(urls, g, new, shuffle_buffer=shuffle_buffer)
    _check_union(before, after, everything, 4, new[0])
    assert len(set(per_rank)) == 1  # equal counts per rank: DDP does not hang
    again, _ = resume(urls, states, new, shuffle_buffer=shuffle_buffer)  # a list of rank states works too
    assert again == after  # deterministic given the checkpoint and the shape


def test_stream_reshape_twice_then_next_epoch_is_normal(urls):
    everything = _all_keys(urls)
    before, states = checkpoint(urls, (4, 2), 2, shuffle_buffer=4)
    middle, states2 = [], []
    for r in range(3):  # 3 x 2, stopped after 3 samples a rank
        got, st = run_rank(_stream(urls, r, 3, shuffle_buffer=4), 2, 3, state=states)
        middle += got
        states2.append(st)
    assert all(s["generation"] == 1 and s["base"] for s in states2)
    after, _ = resume(urls, states2, (2, 1), shuffle_buffer=4)
    seen = collections.Counter(before + middle + after)
    assert set(seen) == set(everything) and sum(seen.values()) - len(everything) <= 3 + 2 + 1
    s = _stream(urls, 0, 2, shuffle_buffer=4)
    s.load_state_dict(states2)
    list(s)
    s.set_epoch(1)
    fresh = _stream(urls, 0, 2, shuffle_buffer=4)
    fresh.set_epoch(1)
    assert [x["__key__"] for x in s] == [x["__key__"] for x in fresh]


def test_same_shape_global_state_is_bit_exact(urls):
    _, states = checkpoint(urls, (2, 2), 4, shuffle_buffer=3)
    full = [run_rank(_stream(urls, r, 2, shuffle_buffer=3), 2)[0] for r in range(2)]
    for r in range(2):
        got, _ = run_rank(_stream(urls, r, 2, shuffle_buffer=3), 2, state=elastic.merge_states(states))
        assert full[r][4:] == got
    stream = _stream(urls, 0, 2, shuffle_buffer=3)
    stream.load_state_dict(elastic.merge_states(states))
    assert stream.stats()["resumed_from"] == {"world_size": 2, "num_workers": 2}


def test_single_rank_state_resumes_on_another_worker_count(urls):
    before, states = checkpoint(urls, (1, 2), 9, shuffle_buffer=4)
    after, _ = resume(urls, states[0], (1, 3), shuffle_buffer=4)  # one rank's state is the whole job's
    assert sorted(before + after) == _all_keys(urls)


def test_own_rank_state_on_another_shape_is_refused(urls):
    _, states = checkpoint(urls, (2, 2), 2)
    s = _stream(urls, 0, 3)
    s.load_state_dict(states[0])
    with pytest.raises(ValueError, match="merge_states"):
        list(s)


# ---- mix -----------------------------------------------------------------------------------------
@pytest.fixture
def two_sources(tmp_path):
    a, _ = write_shards(str(tmp_path / "a"), [40, 40, 40], prefix="a")
    b, _ = write_shards(str(tmp_path / "b"), [60, 60, 60], prefix="b")
    return a, b


def _mix(two_sources, rank, world):
    a, b = two_sources
    return mix([ShardStream(a, rank=rank, world_size=world, shuffle=True, shuffle_buffer=4),
                ShardStream(b, rank=rank, world_size=world, shuffle=True, shuffle_buffer=4)],
               weights=[0.25, 0.75], seed=1, stop="all")


@pytest.mark.parametrize("new", SHAPES)
def test_mix_resumes_on_another_shape_with_weights_on_target(two_sources, new):
    before, states = [], []
    for r in range(4):
        got, st = run_rank(_mix(two_sources, r, 4), 2, 12)
        before += got
        states.append(st)
    g = elastic.merge_states(states)
    after, early = [], list(before)
    for r in range(new[0]):
        got, _ = run_rank(_mix(two_sources, r, new[0]), new[1], state=g)
        after += got
        early += got[: len(got) // 2]  # before source b runs out in this rank
    seen = collections.Counter(before + after)
    everything = {s["__key__"] for u in two_sources for s in ShardStream(u)}
    assert set(seen) == everything  # stop="all": every sample of both sources
    assert sum(seen.values()) - len(everything) <= 2 * (3 + new[0] - 1)
    # on target: until a source runs out, source a's share stays near its weight (its size share is 0.4)
    share = sum(k.startswith("a") for k in early) / len(early)
    assert 0.17 < share < 0.33, share


def test_mix_same_shape_global_state_is_bit_exact(two_sources):
    full = run_rank(_mix(two_sources, 1, 2), 2)[0]
    states = [run_rank(_mix(two_sources, r, 2), 2, 7)[1] for r in range(2)]
    got, _ = run_rank(_mix(two_sources, 1, 2), 2, state=elastic.merge_states(states))
    assert full[7:] == got


# ---- real processes: SIGKILL, torchrun ----------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CHILD = os.path.join(ROOT, "tests", "datapipe", "order", "elastic_child.py")
RUN_TIMEOUT = 120


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _start(tmp_path, name, cfg, torchrun_procs=None):
    path = str(tmp_path / f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    cmd = [sys.executable, CHILD, path]
    if torchrun_procs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc_per_node", str(torchrun_procs), CHILD, path]
    err = open(str(tmp_path / f"{name}.stderr"), "wb")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _finish(proc, tmp_path, name):
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        rc = "timeout"
    if rc != 0:
        with open(str(tmp_path / f"{name}.stderr"), errors="replace") as f:
            pytest.fail(f"{name} child: exit {rc}\n{f.read()[-3000:]}")


def _lines(path):
    with open(path) as f:
        return f.read().split("\n")[:-1]


def _covered(path):
    try:
        return int(torch.load(path, weights_only=False)["samples"])
    except (FileNotFoundError, EOFError, RuntimeError):
        return 0


@pytest.mark.timeout(300)
def test_sigkill_on_2x2_then_resume_on_3x1(tmp_path):
    urls, samples = write_shards(str(tmp_path / "d"), [9, 12, 7, 10, 8])  # 46 samples
    step = random.Random("elastic-kill").randint(3, 6)
    procs = []
    try:
        for r in range(2):
            procs.append(_start(tmp_path, f"killed{r}", {"urls": urls, "rank": r, "world": 2, "workers": 2,
                                                          "log": str(tmp_path / f"killed{r}.log"),
                                                          "ckpt": str(tmp_path / f"rank{r}.pt"), "pause": 0.1}))
        deadline = time.monotonic() + RUN_TIMEOUT
        while min(_covered(str(tmp_path / f"rank{r}.pt")) for r in range(2)) < step:
            assert all(p.poll() is None for p in procs), "a killed-run child exited early"
            assert time.monotonic() < deadline, "the children did not reach the kill step in time"
            time.sleep(0.01)
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)  # the rank and its loader workers, mid-epoch
            p.wait(timeout=10)
        before = []
        for r in range(2):
            logged = _lines(str(tmp_path / f"killed{r}.log"))
            assert "DONE" not in logged
            before += logged[:_covered(str(tmp_path / f"rank{r}.pt"))]
        resumed = []
        for r in range(3):
            resumed.append(_start(tmp_path, f"resumed{r}", {
                "urls": urls, "rank": r, "world": 3, "workers": 1, "log": str(tmp_path / f"resumed{r}.log"),
                "ckpt": str(tmp_path / f"new{r}.pt"), "resume": [str(tmp_path / f"rank{k}.pt") for k in range(2)]}))
        procs += resumed
        after, counts = [], []
        for r, p in enumerate(resumed):
            _finish(p, tmp_path, f"resumed{r}")
            lines = _lines(str(tmp_path / f"resumed{r}.log"))
            assert lines[-1] == "DONE"
            after += lines[:-1]
            counts.append(len(lines) - 1)
        assert len(set(counts)) == 1
        _check_union(before, after, [s["__key__"] for s in samples], 2, 3)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


@pytest.mark.timeout(300)
def test_torchrun_gloo_gather_on_2_then_resume_on_3(tmp_path):
    urls, samples = write_shards(str(tmp_path / "d"), [9, 12, 7, 10, 8])
    glob = str(tmp_path / "global.pt")
    cfg = {"urls": urls, "torchrun": True, "workers": 0, "ckpt": glob}
    first = _start(tmp_path, "save", {**cfg, "log": str(tmp_path / "save%d.log"), "stop_after": 5}, torchrun_procs=2)
    _finish(first, tmp_path, "save")
    g = torch.load(glob, weights_only=False)
    assert elastic.shape(g) == {"world_size": 2, "num_workers": 1}
    before = [k for r in range(2) for k in _lines(str(tmp_path / f"save{r}.log"))]
    assert len(before) == 10
    second = _start(tmp_path, "resume", {**cfg, "log": str(tmp_path / "resume%d.log"), "resume": [glob],
                                         "ckpt": str(tmp_path / "unused.pt")}, torchrun_procs=3)
    _finish(second, tmp_path, "resume")
    after = []
    for r in range(3):
        lines = _lines(str(tmp_path / f"resume{r}.log"))
        assert lines[-1] == "DONE"
        after += lines[:-1]
    _check_union(before, after, [s["__key__"] for s in samples], 2, 3)
