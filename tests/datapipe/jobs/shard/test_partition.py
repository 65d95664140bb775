import io
import json

import numpy as np
import pytest
from PIL import Image

from datapipe.jobs.shard.partition import run_partition, transform_image
from datapipe.jobs.shard.sources import open_source
from tests.datapipe.jobs.shard.test_job import make_image_folder


def _jpeg(size=(200, 150)):
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_transform_image_checks_resizes_and_reencodes():
    good = _jpeg()
    sample = {"__key__": "k", "png": good, "cls": b"1"}
    assert transform_image(sample, resize=None, quality=None, check="open") is sample  # checked, unchanged
    out = transform_image(sample, resize=20, quality=70)
    assert set(out) == {"__key__", "jpg", "cls"} and Image.open(io.BytesIO(out["jpg"])).size == (27, 20)
    cut = {"__key__": "k", "jpg": good[: len(good) // 2]}
    for check in ("open", "decode"):  # the header is intact, the end marker gone
        with pytest.raises(ValueError, match="truncated JPEG"):
            transform_image(cut, resize=None, quality=None, check=check)
    dht = good.index(b"\xff\xc4")
    bad_table = {"__key__": "k", "jpg": good[: dht + 5] + b"\xff" * 16 + good[dht + 21:]}
    assert transform_image(bad_table, resize=None, quality=None, check="open") is bad_table  # headers only
    with pytest.raises(ValueError, match="cannot decode"):
        transform_image(bad_table, resize=None, quality=None, check="decode")
    with pytest.raises(ValueError, match="^empty file$"):
        transform_image({"__key__": "k", "jpg": b""}, resize=None, quality=None)
    with pytest.raises(ValueError, match="not an image"):
        transform_image({"__key__": "k", "jpg": b"plain text"}, resize=None, quality=None)
    text = {"__key__": "k", "jpg": b"plain text"}
    assert transform_image(text, resize=None, quality=None, check="none") is text  # unchecked copy


def test_run_partition_writes_parts_and_a_done_marker(tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=7, classes=("a",))
    (root / "a" / "bad.jpg").write_bytes(b"not a jpeg")
    part = open_source(str(root), partition_size=100).partitions[0]
    job_dir = tmp_path / "job"
    (job_dir / "parts").mkdir(parents=True)
    (job_dir / "done").mkdir()
    job = {"job_dir": str(job_dir), "storage_options": {}, "max_bytes": 1 << 30, "max_count": 3, "index": False,
           "tokenizer": None, "resize": None, "quality": None, "check_images": "open", "strict": False}
    seen = []
    marker = run_partition(job, part, lambda n, b: seen.append(n))
    assert marker["samples"] == 7 and [s["count"] for s in marker["shards"]] == [3, 3, 1]
    assert [s["item"].rsplit("/", 1)[-1] for s in marker["skipped"]] == ["bad.jpg"]
    assert json.load(open(job_dir / "done" / "p000000.json")) == marker
    assert sorted(p.name for p in (job_dir / "parts").iterdir()) == [f"part-000000-{i:06d}.tar" for i in range(3)]
    assert sum(seen) == 7


def test_what_each_check_level_lets_through_as_jobs_md_says():
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(png, format="PNG")
    data = bytearray(png.getvalue())
    at = data.index(b"IDAT") + 24
    data[at:at + 40] = bytes(b ^ 0x5A for b in data[at:at + 40])  # broken compressed data, IEND intact
    broken = {"__key__": "k", "png": bytes(data)}
    assert transform_image(broken, resize=None, quality=None, check="open") is broken
    with pytest.raises(ValueError, match="cannot decode"):
        transform_image(broken, resize=None, quality=None, check="decode")
    good = _jpeg()
    scan_cut = {"__key__": "k", "jpg": good[: len(good) // 2] + b"\xff\xd9"}  # libjpeg fills the rest in gray
    for check in ("open", "decode"):
        assert transform_image(scan_cut, resize=None, quality=None, check=check) is scan_cut
