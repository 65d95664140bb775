"""The datapipe bench command: storage and loader runs end to end, their tables, files and errors."""
import importlib.util
import json
import os

import numpy as np
import pytest

from datapipe import ShardWriter
from datapipe.tools.bench.loader import run_loader
from datapipe.cli import main


def _ordered(lat):
    return lat["p50"] <= lat["p90"] <= lat["p99"]


def test_storage_cli_end_to_end(shard_dir, tmp_path, capsys):
    out = tmp_path / "res" / "storage.json"
    rc = main(["bench", "storage", shard_dir, "--concurrency", "1,2", "--block-size", "4K,64K", "--seconds", "0.3",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "ranged reads" in text
    res = json.loads(out.read_text())
    assert res["environment"]["cpu_count"] == os.cpu_count()
    assert res["storage"] == "local" and res["shards"] == 3
    assert res["bytes"] == sum(os.path.getsize(os.path.join(shard_dir, f)) for f in os.listdir(shard_dir)
                               if f.endswith(".tar"))
    assert {(r["concurrency"], r["block_size"]) for r in res["sweep"]} == {(1, 4096), (1, 65536), (2, 4096), (2, 65536)}
    measured = list(res["sequential"].values()) + list(res["stream"].values()) + res["sweep"]
    for r in measured:
        assert r["mb_per_s"] > 0 and r["bytes"] > 0 and r["requests"] > 0
        assert _ordered(r["latency_ms"])
    # the whole (small) data set fits in the time cap: every file was read
    assert all(r["files"] >= 3 for r in res["sweep"])
    assert res["stream"]["copy"]["samples"] == 110 and res["stream"]["zero_copy"]["samples"] == 110
    cache = res["page_cache"]
    assert set(res["sequential"]) == ({"cold", "warm"} if cache["cold_possible"] else {"warm"})
    assert res["recommendation"]["mb_per_s"] == max(r["mb_per_s"] for r in res["sweep"])
    assert (tmp_path / "res" / "storage.png").stat().st_size > 1000


def test_json_without_matplotlib_writes_the_json_and_says_why_no_plot(shard_dir, tmp_path, capsys, monkeypatch):
    from datapipe.tools import plots

    monkeypatch.setattr(plots, "missing", lambda: "matplotlib is not installed (test)")
    out = tmp_path / "storage.json"
    rc = main(["bench", "storage", shard_dir, "--concurrency", "1", "--block-size", "64K", "--seconds", "0.2",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    assert "no plot: matplotlib is not installed (test)" in capsys.readouterr().err
    assert json.loads(out.read_text())["shards"] == 3 and not (tmp_path / "storage.png").exists()


@pytest.mark.parametrize("target", ["/nonexistent/datapipe-bench", "http://127.0.0.1:9/missing.tar"])
def test_storage_bad_url_exit_1(target, capsys):
    assert main(["bench", "storage", target, "--seconds", "0.1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "datapipe bench storage:" in err and "cannot" in err


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from datapipe.tools.synthetic import make_image_dataset

    d = tmp_path_factory.mktemp("img")
    make_image_dataset(str(d), num_images=24, num_classes=5, shard_max_count=12, size=(64, 48), progress=False)
    return str(d)


HAVE_DALI = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
IMAGE_PIPELINES = ["torch", "webdataset"] + (["dali", "datapipe-images"] if HAVE_DALI else []) + ["datapipe-loader"]


def test_loader_cli_images(image_dir, tmp_path, capsys):
    out = tmp_path / "loader.json"
    rc = main(["bench", "loader", image_dir, "--pipelines", ",".join(IMAGE_PIPELINES),
               "--workers", "0", "--steps", "3", "--warmup", "1", "--batch-size", "4", "--image-size", "32",
               "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "bottleneck:" in text
    res = json.loads(out.read_text())
    assert res["kind"] == "images" and res["samples_in_data"] == 24
    names = [p["name"] for p in res["pipelines"]]
    assert names == IMAGE_PIPELINES
    for p in res["pipelines"]:
        assert not p.get("error"), p
        assert p["samples"] == 12  # 3 steps x 4
        assert p["samples_per_s"] > 0 and p["mb_per_s"] > 0 and p["cpu_cores_used"] >= 0
        assert 0 <= p["wait_fraction"] <= 1
        assert p["gpu_busy_fraction"] == "n/a"
    stages = {s["stage"]: s for s in res["stages"]}
    assert list(stages) == ["fetch", "parse", "decode", "host-to-device", "consume"]
    assert stages["host-to-device"]["samples_per_s"] is None
    slowest = min((s for s in res["stages"] if s["samples_per_s"]), key=lambda s: s["samples_per_s"])
    assert res["bottleneck"]["stage"] == slowest["stage"]
    assert (tmp_path / "loader.png").exists()


def _token_shards(directory, n=64, seed=0):
    from datapipe.jobs.tokenize import npy_bytes

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    with ShardWriter(os.path.join(directory, "shard-%06d.tar"), max_count=32) as w:
        for i in range(n):
            length = int(rng.integers(4, 60))
            w.write({"__key__": f"{i:06d}", "npy": npy_bytes(rng.integers(1, 1000, length))})


def test_loader_tokens(tmp_path):
    _token_shards(str(tmp_path / "tok"))
    res = run_loader(str(tmp_path / "tok"), batch_size=4, steps=3, warmup=0, seq_len=64, workers=0, progress=False,
                     stage_seconds=0.1)
    assert res["kind"] == "tokens"
    by = {p["name"]: p for p in res["pipelines"]}
    assert set(by) == {"datapipe-tokens", "naive-pad"}
    for p in by.values():
        assert not p.get("error"), p
        assert p["tokens_per_s"] > 0 and 0 <= p["padding_fraction"] < 1
    assert by["naive-pad"]["padding_fraction"] > by["datapipe-tokens"]["padding_fraction"]
    assert "pack" in [s["stage"] for s in res["stages"]]
    # a stand-in consume step, no training step: no ceiling ratio, and the result says where to get one
    assert res["ceiling"]["ceiling_ratio"] is None and "doctor --ceiling-steps" in res["ceiling"]["note"]


def test_loader_make_images_and_bad_input(tmp_path, capsys):
    data = tmp_path / "made"
    rc = main(["bench", "loader", str(data), "--make-images", "6", "--pipelines", "datapipe-loader", "--workers", "0",
               "--steps", "1", "--warmup", "0", "--batch-size", "3", "--image-size", "16", "--no-progress"])
    assert rc == 0
    assert any(f.endswith(".tar") for f in os.listdir(data))
    assert main(["bench", "loader", str(data), "--pipelines", "naive-pad", "--no-progress"]) == 1
    assert "do not read images" in capsys.readouterr().err
    assert main(["bench", "loader", str(tmp_path / "missing"), "--no-progress"]) == 1


@pytest.mark.gpu
def test_loader_on_cuda_reports_gpu_busy_and_h2d(image_dir):
    pipelines = ["torch"] + (["datapipe-images"] if HAVE_DALI else [])
    res = run_loader(image_dir, pipelines=pipelines, device="cuda", steps=2, warmup=1, batch_size=4, image_size=32,
                     workers=0, progress=False, stage_seconds=0.1)
    for p in res["pipelines"]:
        assert not p.get("error"), p
        assert isinstance(p["gpu_busy_fraction"], float) and 0 < p["gpu_busy_fraction"] <= 1
    h2d = next(s for s in res["stages"] if s["stage"] == "host-to-device")
    assert h2d["samples_per_s"] > 0


def test_storage_cli_prints_the_warning_on_a_small_set(shard_dir, capsys):
    rc = main(["bench", "storage", shard_dir, "--concurrency", "1", "--block-size", "64K", "--seconds", "0.2",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "warning: the data set is" in out and "start-up and noise" in out


@pytest.mark.slow
def test_loader_peers_adds_the_peer_rows(image_dir, tmp_path, capsys):
    out = tmp_path / "loader.json"
    rc = main(["bench", "loader", image_dir, "--pipelines", "datapipe-loader", "--workers", "0", "--steps", "1",
               "--warmup", "0", "--batch-size", "4", "--image-size", "16", "--peers", "--peers-workers", "0",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "mid-epoch resume, exact rest" in text
    res = json.loads(out.read_text())
    systems = res["peers"]["systems"]
    assert set(systems) == {"torch", "webdataset", "datapipe", "litdata", "mosaicml", "spdl", "grain", "energon"}
    assert systems["datapipe"]["resume"]["exact"] is True
    assert systems["datapipe"]["write"]["images"] == 24
    assert (tmp_path / "loader_peers.png").exists()


@pytest.mark.timeout(60)
def test_bench_storage_says_an_unreachable_host_cannot_be_reached(capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "storage", f"http://127.0.0.1:{port}/shard-{{000000..000001}}.tar", "--seconds", "0.1",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "cannot connect" in err and "FileNotFoundError" not in err
