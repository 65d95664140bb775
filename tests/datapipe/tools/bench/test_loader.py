"""datapipe bench loader as a user runs it: a child process over shards that `datapipe shard` made."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("nvidia.dali")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _photos(folder, exts, n=64):
    """``n`` small images a class over two class folders, cycling through ``exts``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        os.makedirs(os.path.join(folder, cls), exist_ok=True)
        for i in range(n):
            ext = exts[i % len(exts)]
            pixels = (rng.random((24, 32, 3)) * 255).astype("uint8")
            Image.fromarray(pixels).save(os.path.join(folder, cls, f"{i}.{ext}"))


def _bench(data, out_json):
    # batch 64: where DALI's CPU decoder crashed the process on an image it cannot decode
    cmd = [sys.executable, "-m", "datapipe", "bench", "loader", data, "--pipelines", "torch,dali,datapipe-images",
           "--batch-size", "64", "--steps", "2", "--warmup", "0", "--workers", "1", "--image-size", "16",
           "--no-progress", "--json", out_json, "--no-plot"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory):
    """Shards of JPEG/PNG/WebP, and shards where 12 of 128 images are GIFs (which DALI cannot decode)."""
    from datapipe.cli import main

    base = tmp_path_factory.mktemp("bench-loader")
    out = {}
    for name, exts in (("plain", ["jpg", "png", "webp"]), ("gif", ["jpg", "png", "webp"] * 3 + ["gif"])):
        _photos(str(base / f"{name}-photos"), exts)
        assert main(["shard", str(base / f"{name}-photos"), str(base / name), "--max-count", "30",
                     "--no-progress"]) == 0
        out[name] = str(base / name)
    return out


def test_every_default_image_type_runs_through_the_dali_row(shard_dirs, tmp_path):
    r = _bench(shard_dirs["plain"], str(tmp_path / "plain.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {p["name"]: p for p in json.loads((tmp_path / "plain.json").read_text())["pipelines"]}
    assert list(rows) == ["torch", "dali", "datapipe-images"]
    for p in rows.values():
        assert not p.get("error") and p["samples"] == 128, p


def test_images_dali_cannot_decode_refuse_its_row_counted_not_crash(shard_dirs, tmp_path):
    r = _bench(shard_dirs["gif"], str(tmp_path / "gif.json"))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    res = json.loads((tmp_path / "gif.json").read_text())
    rows = {p["name"]: p for p in res["pipelines"]}
    assert list(rows) == ["torch", "dali", "datapipe-images"]
    dali = rows["dali"]
    assert dali["refused_samples"] == 12 and dali["checked_samples"] == 128
    assert "12 of the 128 samples" in dali["error"] and "gif" in dali["error"]
    for name in ("torch", "datapipe-images"):  # PIL and ImageLoader read GIF
        assert not rows[name].get("error") and rows[name]["samples"] == 128, rows[name]
    assert "dali" in r.stdout and "refused" in r.stdout
    assert "decode" in [s["stage"] for s in res["stages"]]
