import os

import pytest

from datapipe.tools.bench.storage import parse_list, run_storage
from datapipe.units import parse_size
from tests.servers import http_server
from tests.shards import write_shards


def _ordered(lat):
    return lat["p50"] <= lat["p90"] <= lat["p99"]


def test_storage_over_http_and_processes(shard_dir):
    with http_server(shard_dir) as (base, faults):
        res = run_storage([base + "/shard-{000000..000002}.tar"], concurrency=[1, 2], block_sizes=[16 << 10],
                          seconds=0.3, processes=True, progress=False)
    assert res["storage"] == "http"
    assert res["page_cache"]["reason"] == "remote: no page cache"
    assert set(res["sequential"]) == {"remote"}
    assert {r["mode"] for r in res["sweep"]} == {"threads", "processes"}
    for r in res["sweep"]:
        assert r["mb_per_s"] > 0 and _ordered(r["latency_ms"])
    assert res["stream"]["copy"]["samples"] == 110
    assert faults.requests > 0


def test_parse_arguments():
    assert parse_size("4M") == 4 << 20 and parse_size("512K") == 512 << 10 and parse_size("100") == 100
    assert parse_list("1,2,4") == [1, 2, 4]
    for bad in ("4X", "", "-1M"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_list("1,a")
    with pytest.raises(ValueError):
        run_storage(["x.tar"], concurrency=[0], progress=False)


def test_targets_are_listed_as_shardstream_lists_them(tmp_path):
    """A folder without a manifest: every shard file ShardStream reads (a .tar.bz2 too), in the same order."""
    import bz2

    from datapipe import ShardStream
    from datapipe.tools.bench.storage import resolve

    urls, _ = write_shards(tmp_path / "d", [3, 4], manifest=False)
    with open(urls[1], "rb") as f:
        data = f.read()
    os.remove(urls[1])
    with open(urls[1] + ".bz2", "wb") as f:
        f.write(bz2.compress(data))
    folder = str(tmp_path / "d")
    assert resolve([folder]) == ShardStream(folder).urls == [urls[0], urls[1] + ".bz2"]
    assert resolve([folder + "/shard-000000.tar", folder]) == [urls[0], urls[0], urls[1] + ".bz2"]
    with http_server(folder) as (base, _):  # a remote folder: its URL ends in "/", as for ShardStream
        write_shards(tmp_path / "d", [3, 4])  # now with a manifest
        assert resolve([base + "/"]) == ShardStream(base + "/").urls == [f"{base}/shard-{i:06d}.tar" for i in range(2)]
