"""A stream's shards counted without a manifest: every failure of the counting pass follows ``on_error`` once."""
import logging
import os
import random

import pytest
import webdataset

from datapipe import DataError, ShardStream
from datapipe.read.options import StorageOptions
from tests.servers import http_server


@pytest.fixture(autouse=True)
def _own_count_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the count cache of remote shards goes under ~/.cache


def _shards(directory):
    """shard-000000.tar: 24 samples of 16 KB (a server that stalls after 16 KB of a response cannot give it);
    shard-000001.tar: 2 small samples (it can). No manifest."""
    os.makedirs(directory)
    rnd, keys = random.Random(3), []
    for shard, (n, size) in enumerate([(24, 16000), (2, 100)]):
        with webdataset.TarWriter(os.path.join(directory, f"shard-{shard:06d}.tar")) as w:
            for i in range(n):
                keys.append(f"s{shard}-{i:03d}")
                w.write({"__key__": keys[-1], "bin": rnd.randbytes(size), "cls": b"1"})
    return keys


STALLING = StorageOptions(timeout=0.5, retries=1, backoff=0.01)


@pytest.mark.timeout(60)
def test_a_read_that_fails_while_counting_is_raised_naming_the_shard(tmp_path):
    _shards(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        faults.stall_after, faults.hang_s = 16384, 30.0
        stream = ShardStream([f"{base}/shard-000000.tar", f"{base}/shard-000001.tar"], storage=STALLING)
        with pytest.raises(DataError, match="counting its samples failed") as info:
            list(stream)
    assert info.value.url.endswith("/shard-000000.tar") and "stalled mid-body" in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_a_read_that_fails_while_counting_is_one_counted_skip(tmp_path, caplog, on_error):
    keys = _shards(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        urls = [f"{base}/shard-000000.tar", f"{base}/shard-000001.tar"]
        faults.stall_after, faults.hang_s = 16384, 30.0
        stream = ShardStream(urls, on_error=on_error, storage=STALLING)
        with caplog.at_level(logging.WARNING, logger="datapipe"):
            got = [s["__key__"] for s in stream]
            assert [s["__key__"] for s in stream] == got, "the next epoch: the same samples, the failure not again"
        assert got == keys[24:], "the shard that could not be counted is skipped whole; the other one is read"
        stats = stream.stats()
        assert stats["errors"] == 1, stats  # once: not again when the read pass (or the next epoch) comes by
        assert 0 < stats["skipped"] < 24, stats  # the complete samples counted before the failure are lost
        assert stats["shards_opened"] == 2, "only the readable shard is opened to read it (once per epoch)"
        assert "counting its samples failed" in stats["last_errors"][0] and "shard-000000.tar" in stats["last_errors"][0]
        assert ("skipped: counting its samples failed" in caplog.text) == (on_error == "warn")
        faults.stall_after = None  # the server recovers: the failure was not cached as a count of 0
        assert [s["__key__"] for s in ShardStream(urls, storage=STALLING)] == keys


def test_one_shard_messages_say_the_shard_not_1_shards(tmp_path, caplog):
    path = tmp_path / "shard-000000.tar"
    with webdataset.TarWriter(str(path)) as w:
        w.write({"__key__": "a", "cls": b"1"})
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        assert len(ShardStream(str(path))) == 1
    assert "no manifest lists the shard: counting" in caplog.text and "1 of 1" not in caplog.text
    with pytest.raises(DataError, match="the shard does not exist") as e:
        len(ShardStream(str(tmp_path / "gone.tar")))
    assert "1 of 1 shards" not in str(e.value)
    with pytest.raises(ValueError, match=r"counts has 1 entry for 2 shards: give one count per URL"):
        ShardStream([str(path), str(path)], counts=[1])


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_brace_range_past_the_last_shard_says_what_the_manifest_lists(tmp_path, caplog, on_error):
    """Issue #44: shard-{000000..000004}.tar over 3 written shards: the two past the end do not exist (said so,
    with the pattern the folder's manifest lists), not "no manifest lists 2 of 5 shards ... run datapipe index"."""
    from tests.shards import write_shards

    write_shards(tmp_path / "out", [4, 4, 4])
    stream = ShardStream(str(tmp_path / "out" / "shard-{000000..000004}.tar"), on_error=on_error)
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        if on_error == "raise":
            with pytest.raises(DataError) as info:
                list(stream)
            text = str(info.value)
        else:
            assert len(list(stream)) == 12
            text = " ".join(stream.stats()["last_errors"])
    assert "2 of 5 shards do not exist" in text and "shard-000003.tar" in text and "shard-000004.tar" in text
    assert f"manifest.json lists 3 shards: {tmp_path / 'out'}/shard-{{000000..000002}}.tar" in text
    assert "no manifest lists" not in caplog.text and "datapipe index" not in caplog.text + text
