"""The loss ledger: what DataLoader workers skip reaches the main process's stats(), counted once."""
import os

import pytest

import loaders
from datapipe import ShardStream, ShardWriter, StorageOptions, mix
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
