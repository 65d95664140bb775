import json
import os

import pytest

from tests.datapipe.jobs.shard.test_job import run_shard, make_image_folder, read_all

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_engine_matches_local(ray_cluster, tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=20, classes=("a", "b"))
    (root / "b" / "broken.jpg").write_bytes(b"garbage")
    opts = dict(max_count=4, partition_size=6, check_images=True, shuffle=True, seed=1, workers=2, progress=False)
    local = run_shard(str(root), str(tmp_path / "local"), engine="local", **opts)
    remote = run_shard(str(root), str(tmp_path / "ray"), engine="ray", **opts)
    assert remote["samples"] == local["samples"] == 20
    assert remote["num_skipped"] == local["num_skipped"] == 1
    ml = json.load(open(tmp_path / "local" / "manifest.json"))
    mr = json.load(open(tmp_path / "ray" / "manifest.json"))
    assert mr["shards"] == ml["shards"] and mr["classes"] == ml["classes"]  # byte-identical shards
    assert [s["__key__"] for s in read_all(str(tmp_path / "ray"))] == [s["__key__"] for s in read_all(str(tmp_path / "local"))]
    # strict failures come back from the workers as a DataError naming the item
    from datapipe.errors import DataError

    with pytest.raises(DataError, match="broken.jpg"):
        run_shard(str(root), str(tmp_path / "strict"), engine="ray", strict=True, **opts)
    assert not os.path.exists(tmp_path / "strict" / "manifest.json")


def test_ray_engine_shuffles_by_default_and_writes_full_shards_like_local(ray_cluster, tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=130, classes=("a", "b", "c"), size=(24, 16))
    (root / "b" / "broken.jpg").write_bytes(b"garbage")
    opts = dict(max_count=20, resize=8, workers=2, progress=False)  # a transform job: partitions run on the workers
    local = run_shard(str(root), str(tmp_path / "local"), engine="local", **opts)
    remote = run_shard(str(root), str(tmp_path / "ray"), engine="ray", **opts)
    assert remote["samples"] == local["samples"] == 130 and remote["num_skipped"] == 1
    ml = json.load(open(tmp_path / "local" / "manifest.json"))
    mr = json.load(open(tmp_path / "ray" / "manifest.json"))
    assert mr["shards"] == ml["shards"] and [s["count"] for s in mr["shards"]] == [20] * 6 + [10]
    keys = [s["__key__"] for s in read_all(str(tmp_path / "ray"))]
    assert keys != sorted(keys) and sorted(keys) == sorted(s["__key__"] for s in read_all(str(tmp_path / "local")))
