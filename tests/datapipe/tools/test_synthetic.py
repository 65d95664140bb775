import io
import json
import os

import numpy as np
import pytest
import webdataset
from PIL import Image, JpegImagePlugin

from datapipe.tools.synthetic import iter_image_samples, make_image_dataset

SMALL = dict(size=(160, 120), num_classes=10)


def test_samples_are_deterministic_for_a_seed():
    a = list(iter_image_samples(4, seed=3, **SMALL))
    b = list(iter_image_samples(4, seed=3, **SMALL))
    c = list(iter_image_samples(4, seed=4, **SMALL))
    assert [s["jpg"] for s in a] == [s["jpg"] for s in b]
    assert all(x["jpg"] != y["jpg"] for x, y in zip(a, c))
    # sample i depends only on (seed, i): starting later gives the same bytes
    later = list(iter_image_samples(2, seed=3, start=2, **SMALL))
    assert [s["jpg"] for s in later] == [s["jpg"] for s in a[2:]]
    assert [s["__key__"] for s in later] == ["00000002", "00000003"]


def test_images_are_varied_real_jpegs():
    samples = list(iter_image_samples(40, seed=0, num_classes=5))
    sizes, samplings, qualities_seen, labels = [], set(), set(), set()
    for s in samples:
        im = Image.open(io.BytesIO(s["jpg"]))
        assert im.format == "JPEG" and im.mode == "RGB"
        w, h = im.size
        assert 300 <= min(w, h) <= 430 and 440 <= max(w, h) <= 570
        samplings.add(JpegImagePlugin.get_sampling(im))
        qualities_seen.add(len(s["jpg"]))
        labels.add(int(s["cls"].decode("ascii")))
        pixels = np.asarray(im, dtype=np.float32)
        assert pixels.std() > 10  # a photograph, not a flat image
        sizes.append(len(s["jpg"]))
    assert samplings == {0, 2}  # 4:4:4 and 4:2:0 both present
    assert labels <= set(range(5)) and len(labels) > 1
    assert 40_000 < np.mean(sizes) < 200_000


def test_make_image_dataset_writes_shards_manifest_and_index(tmp_path):
    out = tmp_path / "ds"
    info = make_image_dataset(str(out), num_images=10, seed=1, shard_max_count=4, index=True, progress=False, **SMALL)
    assert info["num_images"] == 10 and len(info["shards"]) == 3
    assert all(os.path.exists(p[: -len(".tar")] + ".idx") for p in info["shards"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 2]
    read = list(webdataset.WebDataset(info["shards"], shardshuffle=False))
    expected = list(iter_image_samples(10, seed=1, **SMALL))
    assert [r["__key__"] for r in read] == [e["__key__"] for e in expected]
    assert [r["jpg"] for r in read] == [e["jpg"] for e in expected]
    assert [r["cls"] for r in read] == [e["cls"] for e in expected]
    assert info["bytes"] == sum(len(e["jpg"]) for e in expected)


def test_parallel_generation_gives_the_same_bytes(tmp_path):
    a = make_image_dataset(str(tmp_path / "a"), num_images=70, seed=2, shard_max_count=100, progress=False,
                           num_workers=2, **SMALL)
    b = make_image_dataset(str(tmp_path / "b"), num_images=70, seed=2, shard_max_count=100, progress=False, **SMALL)
    assert open(a["shards"][0], "rb").read() == open(b["shards"][0], "rb").read()


@pytest.mark.parametrize("kwargs", [dict(num_classes=0), dict(quality=(95, 85)), dict(size=(8, 8)),
                                    dict(num_images=-1)])
def test_bad_arguments(kwargs):
    args = {"num_images": 1, **kwargs}
    with pytest.raises(ValueError):
        list(iter_image_samples(**args))
