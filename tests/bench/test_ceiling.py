"""bench/ceiling.py: the CPU smoke run writes rows for every loader and loop style; the profile's arithmetic."""
import json
import os

import pytest

from bench import ceiling
from bench.common import analyse


@pytest.mark.slow
def test_quick_cpu_run_writes_a_row_per_loader_and_loop(tmp_path):
    pytest.importorskip("nvidia.dali")
    out = ceiling.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--data", str(tmp_path / "images"),
                        "--tokens-dir", str(tmp_path / "tokens")])
    saved = json.loads((tmp_path / "ceiling.json").read_text())
    assert saved["rows"] == out["rows"] and saved["gpu"] == "cpu" and saved["cpu_count"] >= 1
    assert {"date", "versions", "loops"} <= set(saved) and saved["versions"]["torch"]
    done = {(r["loader"], r["loop"]) for r in saved["rows"] if "ceiling_ratio" in r}
    errors = [r for r in saved["rows"] if "error" in r]
    assert not errors, errors
    assert done == {(n, loop) for n in ceiling.DEFAULT_LOADERS for loop in ceiling.LOOPS}
    for r in saved["rows"]:
        assert r["ceiling_ratio"] > 0 and 0 <= r["wait_fraction"] < 1
        assert r["ceiling"] == pytest.approx((r["ceiling_before"] + r["ceiling_after"]) / 2, abs=0.1)
    assert {(s["loader"], s["loop"]) for s in saved["summary"]} == done
    sets = {(r["config"], r["step"], r["compile_mode"], r["arch"]) for r in saved["rows"] if r["loader"] == "dali"}
    assert sets == {("eager", "eager", None, "resnet18"), ("compiled", "compiled", "default", "resnet18"),
                    ("cuda_graphs", "compiled", "reduce-overhead", "resnet18"), ("resnet18", "eager", None, "resnet18")}
    for r in saved["rows"]:
        assert {"loader", "loop", "step", "compile_mode", "arch", "round", "ceiling_ratio"} <= set(r)
    assert {r["arch"] for r in saved["rows"] if r["loader"] == "tokenloader"} == {"llama-162m"}


def test_unknown_loader_or_loop_is_refused():
    with pytest.raises(SystemExit):
        ceiling.parse(["--loaders", "imageloader,nope"])
    with pytest.raises(SystemExit):
        ceiling.parse(["--loops", "sometimes"])


def test_run_loop_counts_steps_and_waits():
    import torch

    calls = []
    r = ceiling.run_loop(ceiling.replay((torch.zeros(3), 0)), calls.append, steps=5, warmup=2, every=50,
                         device=torch.device("cpu"), count=lambda b: len(b[0]))
    assert len(calls) == 7 and r["rate"] > 0 and 0 <= r["wait_fraction"] < 1


def test_overlap_of_training_and_loader_streams():
    events = [{"name": "k", "ts": 0, "dur": 10, "args": {"stream": 7}},
              {"name": "k", "ts": 20, "dur": 10, "args": {"stream": 7}},
              {"name": "decode", "ts": 5, "dur": 20, "args": {"stream": 13}}]
    a = analyse(events, 1, 7)
    assert a["train_kernel_ms_per_step"] == 0.02 and a["loader_device_ms_per_step"] == 0.02
    assert a["overlap_ms_per_step"] == 0.01  # 5..10 and 20..25
    assert set(a["streams"]) == {"7", "13"}


def test_host_waits_for_the_gpu_are_counted_apart_from_the_device_work():
    events = [{"name": "k", "cat": "kernel", "ts": 0, "dur": 10, "args": {"stream": 7}},
              {"name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 12, "dur": 30, "args": {}},
              {"name": "cudaDeviceSynchronize", "cat": "cuda_runtime", "ts": 50, "dur": 10, "args": {}},
              {"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 1, "dur": 2, "args": {}}]
    a = analyse(events, 2, 7)
    assert a["host_syncs_per_step"] == 1.0 and a["host_sync_ms_per_step"] == 0.02  # 40 us over 2 steps
    assert set(a["streams"]) == {"7"} and a["loader_device_ms_per_step"] == 0.0  # host calls are not device work
    assert a["wall_ms_per_step"] == 0.005  # the device events' span only


def test_summary_groups_rows_by_loader_and_loop():
    rows = [{"loader": "a", "loop": "runs_ahead", "step": "eager", "ceiling_ratio": r, "wait_fraction": 0.0,
             "rate": 1.0} for r in (0.9, 1.0)] + [{"loader": "a", "loop": "runs_ahead", "error": "x"}]
    (s,) = ceiling.summary(rows)
    assert s["rows"] == 2 and s["ceiling_ratio"] == 0.95 and (s["min"], s["max"]) == (0.9, 1.0)


def test_rows_of_another_connections_setting_are_summarised_apart(tmp_path):
    rows = [{"loader": "a", "loop": "runs_ahead", "step": "eager", "ceiling_ratio": r, "wait_fraction": 0.0,
             "rate": 1.0, "cuda_device_max_connections": c} for r, c in ((0.9, None), (1.0, "32"))]
    by = {s["connections"]: s for s in ceiling.summary(rows)}
    assert by["default"]["ceiling_ratio"] == 0.9 and by["32"]["ceiling_ratio"] == 1.0
    (tmp_path / "ceiling.json").write_text(json.dumps({"rows": rows}))
    assert ceiling.earlier_record(ceiling.parse(["--out", str(tmp_path), "--append"]))["rows"] == rows
    assert ceiling.earlier_record(ceiling.parse(["--out", str(tmp_path / "none")])) == {}


def test_append_keeps_the_files_keys_and_numbers_rounds_on():
    def row(step, round_):
        return {"loader": "a", "loop": "runs_ahead", "step": step, "round": round_}

    earlier = {"gpu": "G", "date": "first", "config": {"steps": "100"}, "probe": {"kept": True}, "summary": [1],
               "rows": [row("eager", 0), row("eager", 1), row("compiled", 0)]}
    run = {"gpu": "G", "date": "second", "versions": {"torch": "x"}, "config": {"steps": "50"}, "rows": [row("eager", 2)]}
    out = ceiling.appended(earlier, run)
    assert out["date"] == "first" and out["config"] == {"steps": "100"} and out["probe"] == {"kept": True}
    assert "summary" not in out and out["appended"] == [{"date": "second", "versions": {"torch": "x"},
                                                          "config": {"steps": "50"}, "cpu_count": None,
                                                          "cuda_device_max_connections": None,
                                                          "cuda_visible_devices": None, "usable_cores": None}]
    assert out["rows"] is run["rows"] and [r["round"] for r in out["rows"]] == [0, 1, 0, 2]
    assert ceiling.next_round(out["rows"], "eager") == 3 and ceiling.next_round(out["rows"], "compiled") == 1
    assert ceiling.next_round([], "eager") == 0
    with pytest.raises(SystemExit, match="measured on 'G'"):
        ceiling.appended(earlier, {**run, "gpu": "other"})


def test_runs_side_by_side_merge_into_one_record(tmp_path):
    """Three processes, one round each on its own GPU (``--first-round``), make one ceiling.json."""
    import subprocess
    import sys

    def run(round_, gpu="G"):
        return {"gpu": gpu, "date": f"d{round_}", "cuda_visible_devices": str(round_), "usable_cores": 16,
                "rows": [{"config": "eager", "loader": "a", "loop": "runs_ahead", "step": "eager", "round": round_,
                          "ceiling_ratio": 0.9 + round_ / 100, "wait_fraction": 0.0, "rate": 1.0}]}

    out = ceiling.merged([run(0), run(1), run(2)])
    assert [r["round"] for r in out["rows"]] == [0, 1, 2] and out["date"] == "d0"
    assert [a["cuda_visible_devices"] for a in out["appended"]] == ["1", "2"]
    assert out["summary"][0]["rows"] == 3 and out["summary"][0]["ceiling_ratio"] == 0.91
    with pytest.raises(SystemExit, match="same number"):
        ceiling.merged([run(0), run(0)])
    with pytest.raises(SystemExit, match="measured on 'G'"):
        ceiling.merged([run(0), run(1, gpu="H")])
    paths = []
    for r in range(3):
        paths.append(tmp_path / f"r{r}.json")
        paths[-1].write_text(json.dumps({"environment": {}, **run(r)}))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "bench.ceiling_record", str(tmp_path / "out"), *map(str, paths)],
                          cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(json.loads((tmp_path / "out" / "ceiling.json").read_text())["rows"]) == 3
    assert subprocess.run([sys.executable, "-m", "bench.ceiling_record"], cwd=root).returncode == 2


def test_the_main_run_plans_every_row_set_and_configs_pick_some():
    args = ceiling.parse([])
    assert (args.steps, args.warmup, args.rounds) == (300, 40, 3)  # the first 300 steps after 40 of a fresh loader
    rows = ceiling.plan(args)
    assert [c for c, _, _ in rows] == ["eager"] * 10 + ["compiled"] * 2 + ["cuda_graphs"] * 2 + ["resnet18"] * 2
    assert {(n, loop) for c, n, loop in rows if c != "eager"} == {("imageloader", "runs_ahead"), ("dali", "runs_ahead")}
    assert {(n, loop) for c, n, loop in rows if c == "eager"} == {
        (n, loop) for n in ceiling.DEFAULT_LOADERS for loop in ceiling.LOOPS}
    some = ceiling.plan(ceiling.parse(["--configs", "cuda_graphs,eager", "--loaders", "imageloader,tokenloader",
                                       "--loops", "runs_ahead"]))
    assert some == [("cuda_graphs", "imageloader", "runs_ahead"), ("eager", "imageloader", "runs_ahead"),
                    ("eager", "tokenloader", "runs_ahead")]
    with pytest.raises(SystemExit):
        ceiling.parse(["--configs", "fastest"])


def test_rows_of_another_step_are_summarised_apart():
    rows = [{"config": c, "loader": "a", "loop": "runs_ahead", "step": s, "compile_mode": m, "arch": "resnet50",
             "ceiling_ratio": r, "wait_fraction": 0.0, "rate": 1.0}
            for c, s, m, r in (("compiled", "compiled", "default", 0.9), ("cuda_graphs", "compiled", "reduce-overhead", 0.8))]
    by = {s["config"]: s for s in ceiling.summary(rows)}
    assert by["compiled"]["ceiling_ratio"] == 0.9 and by["cuda_graphs"]["compile_mode"] == "reduce-overhead"
    assert ceiling.next_round(rows) == 0 and ceiling.next_round([{**rows[0], "round": 2}]) == 3


def test_imageloader_cuda_keeps_the_cuda_decoder_and_is_not_run_by_default(tmp_path):
    """``imageloader_cuda``: ImageLoader with ``hw_decoder_load=0.0`` (no move), only when named."""
    pytest.importorskip("nvidia.dali")
    assert "imageloader_cuda" not in ceiling.parse([]).loaders
    args = ceiling.parse(["--quick", "--device", "cpu", "--loaders", "imageloader_cuda", "--data",
                          str(tmp_path / "images")])
    data = ceiling.prepare_data(args)
    feed, owner = ceiling.make_feed("imageloader_cuda", args, data)
    try:
        assert owner.decode.hw_decoder_load == 0.0 and not owner.stats()["decoder"]["switchable"]
        assert next(feed)[0].shape[0] == args.batch_size
    finally:
        ceiling.close_feed(feed, owner)


def test_the_profile_of_the_token_rows_takes_tokenloader_against_its_own_ceiling(monkeypatch, tmp_path):
    """profile_part's plumbing, with the profiler's windows stood in for: the ceiling's heaviest stream is the
    training one, each loader's window is analysed against it, and the stretch is their kernels' ratio."""
    from types import SimpleNamespace

    windows = []

    def window(batches, step, args, steps, trace_dir, name):
        windows.append(name)
        train = 11.0 if name.endswith("ceiling") else 12.1  # ms of training kernels per step x 10 steps
        return [{"name": "gemm", "cat": "kernel", "ts": 0, "dur": train * 1e3 * steps, "args": {"stream": 7}},
                {"name": "copy", "cat": "gpu_memcpy", "ts": 0, "dur": 50.0 * steps, "args": {"stream": 9}},
                {"name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 5, "dur": 100.0, "args": {}}]

    monkeypatch.setattr(ceiling, "profile_window", window)
    monkeypatch.setattr(ceiling, "make_feed", lambda name, args, data: (iter(()), SimpleNamespace()))
    monkeypatch.setattr(ceiling, "close_feed", lambda feed, owner: None)
    bench = ceiling.Bench(SimpleNamespace(arch=None), {})
    bench.cached["tokens"] = {"input_ids": None}
    monkeypatch.setattr(bench, "step", lambda fmt, cfg: fmt)
    out = ceiling.profile_part(bench, SimpleNamespace(), str(tmp_path), "eager", "tokens")
    assert windows == ["eager_tokens_ceiling", "eager_tokenloader"]
    assert out["format"] == "tokens" and set(out) == {"config", "format", "steps", "ceiling", "tokenloader"}
    t = out["tokenloader"]
    assert t["train_stream"] == "7" and t["train_kernel_stretch"] == 1.1 and t["loader_copy_ms_per_step"] == 0.05
    assert t["host_syncs_per_step"] == 0.1


def test_the_profile_takes_the_image_loaders_the_run_names(monkeypatch, tmp_path):
    """With image loaders named (a probe such as ``nvimg``), the profile takes those, in order, instead of
    ImageLoader and the hand loop; a token loader named beside them stays out of the images' profile."""
    from types import SimpleNamespace

    windows = []

    def window(batches, step, args, steps, trace_dir, name):
        windows.append(name)
        return [{"name": "gemm", "cat": "kernel", "ts": 0, "dur": 1e4 * steps, "args": {"stream": 7}}]

    monkeypatch.setattr(ceiling, "profile_window", window)
    monkeypatch.setattr(ceiling, "make_feed", lambda name, args, data: (iter(()), SimpleNamespace()))
    monkeypatch.setattr(ceiling, "close_feed", lambda feed, owner: None)
    bench = ceiling.Bench(SimpleNamespace(arch=None), {})
    bench.cached["images"] = (None, None)
    monkeypatch.setattr(bench, "step", lambda fmt, cfg: fmt)
    args = SimpleNamespace(loaders=["nvimg@stream", "tokenloader", "imageloader"])
    out = ceiling.profile_part(bench, args, str(tmp_path), "cuda_graphs", "images")
    assert windows == ["cuda_graphs_images_ceiling", "cuda_graphs_nvimg@stream", "cuda_graphs_imageloader"]
    assert set(out) == {"config", "format", "steps", "ceiling", "nvimg@stream", "imageloader"}
    out = ceiling.profile_part(bench, SimpleNamespace(loaders=["tokenloader"]), str(tmp_path), "eager", "images")
    assert {"imageloader", "dali"} <= set(out)  # none named: the two it always took
