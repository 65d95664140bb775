"""The loss ledger: what DataLoader workers skip reaches the main process's stats(), counted once."""
import copy
import multiprocessing
import os
import pickle

import pytest
import torch

import loaders
from datapipe import DataError, ShardStream, ShardWriter, StorageOptions, mix
from datapipe.errors import ErrorPolicy
from datapipe.read.ledger import Ledger
from tests.servers import http_server
from tests.shards import make_samples, write_shards

IO = ("retries", "shards_opened", "bytes_read", "cache_hits")


@pytest.fixture
def one_missing(tmp_path):
    urls, samples = write_shards(str(tmp_path), [10, 20, 10])
    os.remove(urls[1])  # the manifest still lists its 20 samples
    return urls, samples


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_lost_samples_reach_the_loader_and_the_stream(one_missing, num_workers):
    urls, samples = one_missing
    stream = ShardStream(urls, on_error="skip")
    loader = loaders.DataLoader(stream, batch_size=4, num_workers=num_workers)
    keys = [k for batch in loader for k in batch["__key__"]]
    assert sorted(keys) == sorted(s["__key__"] for s in samples if not s["__key__"].startswith("s1-"))
    for stats in (loader.stats(), stream.stats()):
        assert stats["skipped"] == 20 and stats["errors"] == 1, stats  # one fault, however many workers met it
        assert any("shard-000001.tar" in m for m in stats["last_errors"])
    assert stream.stats()["samples"] == 20 and stream.stats()["shards_opened"] == 2


def test_counted_once_per_epoch_with_persistent_and_fresh_workers(one_missing):
    urls, _ = one_missing
    for persistent in (True, False):
        stream = ShardStream(urls, on_error="skip")
        loader = loaders.DataLoader(stream, batch_size=4, num_workers=2, persistent_workers=persistent)
        for epoch in range(3):
            loader.set_epoch(epoch)
            list(loader)
            stats = loader.stats()  # this pass's losses, as its samples; the running total beside
            assert (stats["skipped"], stats["skipped_total"]) == (20, 20 * (epoch + 1)), (persistent, epoch)
        assert stream.stats()["samples"] == 60


def test_padded_repeats_under_ddp_and_a_mix(one_missing):
    urls, _ = one_missing
    stream = ShardStream(urls, on_error="skip", rank=0, world_size=2)
    loader = loaders.DataLoader(stream, batch_size=5, num_workers=1)
    got = sum(len(b["__key__"]) for b in loader)
    assert got == len(stream) == 20  # the rank still yields its planned count
    stats = loader.stats()
    assert stats["skipped"] == 10 and stats["padded"] == 10
    m = mix([ShardStream(urls, on_error="skip")], weights=[1])
    loader = loaders.DataLoader(m, batch_size=4, num_workers=2)
    list(loader)
    assert loader.stats()["skipped"] == 20 and m.stats()["skipped"] == 20


@pytest.mark.parametrize("read_workers", [0, 2])
def test_image_loader_reader_workers_count_stream_losses_once(tmp_path, read_workers):
    pytest.importorskip("nvidia.dali")
    from datapipe.tar.manifest import make_manifest, write_manifest
    from loaders import ImageLoader
    from loaders.images.options import ReadOptions
    from tests.datapipe.test_decode import image_shards

    urls = image_shards(tmp_path, [8, 12, 8])
    write_manifest(str(tmp_path), make_manifest([{"name": os.path.basename(u), "count": n, "bytes": os.path.getsize(u),
                                                  "sha256": ""} for u, n in zip(urls, [8, 12, 8])]))
    os.remove(urls[1])
    lo = ImageLoader(ShardStream(urls, on_error="skip"), batch_size=4, image_size=8, device="cpu", train=False,
                     read=ReadOptions(read_workers=read_workers, reader="stream"))
    assert sum(len(labels) for _, labels in lo) == 16
    stats = lo.stats()
    assert stats["skipped"] == stats["stream"]["skipped"] == 12
    assert any("shard-000001.tar" in m for m in stats["last_errors"])


def _web(root):
    """5 shards of 10 samples with a sha256 manifest: with 2 workers, shard 2 is split between them."""
    os.makedirs(root)
    with ShardWriter(os.path.join(root, "shard-%06d.tar"), max_count=10) as w:
        for sample in make_samples(50, size=2000):
            w.write(sample)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_io_counts_of_the_workers_reach_both_stats(tmp_path, num_workers):
    _web(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        urls = [f"{base}/shard-{i:06d}.tar" for i in range(5)]
        stream = ShardStream(urls, cache_dir=str(tmp_path / "cache"),
                             storage=StorageOptions(retries=3, timeout=10, backoff=0.01))
        assert len(stream) == 50  # the manifest is read here, before the faults (its retries are not counted)
        faults.resets = 3  # cut mid-body, each resumed
        loader = loaders.DataLoader(stream, batch_size=4, num_workers=num_workers, collate_fn=list)
        assert sum(len(b) for b in loader) == 50
        opened = 5 + (num_workers == 2)  # the split shard is opened by both workers
        for stats in (loader.stats(), stream.stats()):
            assert {k: stats.get(k) for k in ("retries", "shards_opened", "errors")} == \
                {"retries": 3, "shards_opened": opened, "errors": 0}, stats
            assert stats["bytes_read"] > 50 * 2000 and stats["cache_hits"] <= opened - 5, stats
        first = {k: loader.stats()[k] for k in IO}
        assert sum(len(b) for b in loader) == 50  # the next epoch: every shard from the cache
        stats = loader.stats()
        assert (stats["cache_hits"], stats["shards_opened"], stats["retries"]) == (opened, opened, 0), stats
        assert stats["cache_hits_total"] == first["cache_hits"] + opened
        assert stream.stats()["cache_hits"] == stats["cache_hits_total"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_that_always_fails_is_one_error_however_many_workers_read_it(tmp_path, num_workers):
    _web(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        stream = ShardStream(f"{base}/", on_error="skip", storage=StorageOptions(retries=1, timeout=5, backoff=0.01))
        assert len(stream) == 50
        os.remove(str(tmp_path / "web" / "shard-000002.tar"))  # 404 from now on: the shard both workers share
        loader = loaders.DataLoader(stream, batch_size=4, num_workers=num_workers, collate_fn=list)
        for epoch in range(2):
            assert sum(len(b) for b in loader) == 40
            assert (loader.stats()["errors"], loader.stats()["skipped"]) == (1, 10), loader.stats()
        assert (stream.stats()["errors"], stream.stats()["skipped"]) == (2, 20), stream.stats()


def _workers(main, n):
    """``n`` DataLoader workers' copies of the ledger ``main`` (as a forked worker's: its own counts, the shared
    rows), each entered at its row."""
    out = []
    for worker in range(n):
        w = object.__new__(Ledger)  # as fork copies it (copy.copy pickles: without the lock)
        w.__dict__.update(main.__dict__, counts=dict(main.counts), errors=ErrorPolicy("skip"), _pid=None)
        assert w.enter(worker)
        out.append(w)
    return out


def _lose_split_part(w, shard, n=5):
    """What the segment reader does when a worker cannot read its part (``n`` samples) of a split ``shard``."""
    w.errors(DataError("cannot open", url=f"shard-{shard}.tar"), lost=n, counted=w.first_fault(shard))
    w.publish()


def _errors(main):
    return main.totals()["errors"]


def test_a_rerun_of_an_epoch_counts_its_split_fault_before_the_other_worker_begins_it():
    """Persistent workers, epoch 0 twice. In the first pass worker 1 counts the fault of the split shard 2 and worker
    0 leaves it to it; in the second, worker 0 meets the fault before worker 1 begins that pass (and worker 1 may not
    meet it again: a transient failure, or its pass stops first): worker 1's mark of the first pass is not this
    pass's count. Was: left to it, no error counted."""
    main = Ledger(ErrorPolicy("skip"))
    main.open_workers(2)
    w0, w1 = _workers(main, 2)
    for w in (w0, w1):
        w.begin(w.pass_mark(0))
    _lose_split_part(w1, 2)
    _lose_split_part(w0, 2)
    assert _errors(main) == 1
    main.open_workers(2, again=True)  # the next pass, in the same workers
    w0.begin(w0.pass_mark(0))
    _lose_split_part(w0, 2)
    assert _errors(main) == 2
    w1.begin(w1.pass_mark(0))
    _lose_split_part(w1, 2)
    assert _errors(main) == 2 and main.totals()["skipped"] == 20


def test_a_pass_taken_before_the_next_begins_keeps_its_own_mark():
    """A worker fixes its pass at iter() (``pass_mark``), even if it reads it after the main process numbered the next
    (a pass left early: its rest is read while the next begins); a mix restarts a stream at the next epoch in a
    pass: another fault to count."""
    main = Ledger(ErrorPolicy("skip"))
    main.open_workers(2)
    w0, w1 = _workers(main, 2)
    old = w0.pass_mark(0)
    main.open_workers(2, again=True)
    w0.begin(old)
    _lose_split_part(w0, 3)
    w1.begin(w1.pass_mark(0))
    _lose_split_part(w1, 3)  # the new pass's fault: counted again
    w1.begin(w1.pass_mark(1))
    _lose_split_part(w1, 3)  # the stream restarted at epoch 1
    w0.begin(w0.pass_mark(1))
    _lose_split_part(w0, 3)
    assert _errors(main) == 3


def _meet_faults(main, worker, rounds, barrier, won):
    """(A forked worker) meet the fault of shards 0, 1... at the same instant as the others."""
    main.enter(worker)
    main.begin(main.pass_mark(0))
    for shard in range(rounds):
        barrier.wait()
        won[shard, worker] = int(main.first_fault(shard))


@pytest.mark.timeout(120)
def test_workers_that_meet_a_split_fault_at_once_count_it_exactly_once():
    """Was: a worker that looked and found no mark, then was preempted before it wrote that it counts, looked
    undecided to a lower worker, which counted too (2 errors; 4 in 60 loader runs under CPU load)."""
    ctx, workers, rounds = multiprocessing.get_context("fork"), 4, 3000
    main = Ledger(ErrorPolicy("skip"))
    main.open_workers(workers, context=ctx)
    won = torch.zeros((rounds, workers), dtype=torch.int64).share_memory_()
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_meet_faults, args=(main, w, rounds, barrier, won)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert [p.exitcode for p in procs] == [0] * workers
    assert won.sum(1).tolist() == [1] * rounds


def test_a_ledger_pickles_after_a_pass_with_workers(one_missing):
    """The marks' lock travels only to a worker being started; a copy made otherwise goes without it."""
    stream = ShardStream(one_missing[0], on_error="skip")
    list(loaders.DataLoader(stream, batch_size=4, num_workers=2))
    again = pickle.loads(pickle.dumps(stream))
    assert again.stats()["errors"] == 1 and copy.deepcopy(stream).stats()["skipped"] == 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_counted_once_with_workers_that_do_not_fork(one_missing, context):
    urls, _ = one_missing
    stream = ShardStream(urls, on_error="skip")
    loader = loaders.DataLoader(stream, batch_size=4, num_workers=2, multiprocessing_context=context)
    assert sum(len(b["__key__"]) for b in loader) == 20
    assert (loader.stats()["errors"], loader.stats()["skipped"]) == (1, 20)


def test_a_rerun_epoch_with_persistent_workers_counts_the_split_fault_each_pass(one_missing):
    urls, _ = one_missing  # with 2 and 3 workers, the missing shard is split between them
    for workers in (2, 3):
        stream = ShardStream(urls, on_error="skip")
        loader = loaders.DataLoader(stream, batch_size=4, num_workers=workers, persistent_workers=True)
        for n in range(1, 4):
            loader.set_epoch(0)  # the same epoch again, in the same workers
            assert sum(len(b["__key__"]) for b in loader) == 20
            stats = loader.stats()
            assert (stats["errors"], stats["skipped"], stats["errors_total"]) == (1, 20, n), (workers, stats)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("faults,shards", [(20, None), (300, 400)])
def test_many_split_faults_in_one_pass_are_each_counted_once(workers, faults, shards):
    """A worker that counts many split shards' faults in one pass (an elastic resume plans runs of shards that earlier
    workers read in part) keeps the mark of the first, which the worker before it meets only at its run's end. Was:
    each worker kept its last 8 marks, so the 9th fault wiped the first and the shard's error was counted twice."""
    main = Ledger(ErrorPolicy("skip"))
    main.open_workers(workers, **({} if shards is None else {"shards": shards}))
    ws = _workers(main, workers)
    for w in ws:
        w.begin(w.pass_mark(0))
    _lose_split_part(ws[1], 0, n=1)  # worker 1's first part: shard 0, whose head is worker 0's last part
    for shard in range(1, faults):
        _lose_split_part(ws[1], shard, n=1)
    _lose_split_part(ws[0], 0, n=1)
    if workers == 3:
        _lose_split_part(ws[2], faults - 1, n=1)  # worker 2's first part: the tail of worker 1's last shard
    assert (_errors(main), main.totals()["skipped"]) == (faults, faults + workers - 1)
