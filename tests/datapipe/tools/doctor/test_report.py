import json
import sys
import time

import pytest
import torch

import datapipe.tools.doctor.report as doctor_report
from datapipe.cli import main
from datapipe.tools.doctor.report import Doctor


def sleepy(n, fetch_s):
    for i in range(n):
        time.sleep(fetch_s)
        yield torch.full((4,), float(i))


class SleepyDataset(torch.utils.data.Dataset):
    def __init__(self, n, fetch_s):
        self.n, self.fetch_s = n, fetch_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.fetch_s)
        return torch.zeros(2)


def test_wait_fraction_of_known_sleeps(tmp_path):
    """A loader sleeping 20 ms per batch and a 10 ms step: about 2/3 of the time is data wait."""
    with doctor_report.doctor(report=str(tmp_path / "d.json"), print_report=False) as d:
        for _ in d.wrap(sleepy(15, 0.02)):
            time.sleep(0.01)
    rep = json.loads((tmp_path / "d.json").read_text())
    assert rep["steps"] == 15
    assert 0.5 < rep["wait_fraction"] < 0.8
    assert 0.2 < rep["compute_fraction"] < 0.45
    assert rep["other_fraction"] < 0.1
    assert 18 <= rep["wait_ms"]["p50"] <= 60 and 9 <= rep["compute_ms"]["p50"] <= 40
    assert rep["wait_ms"]["p50"] <= rep["wait_ms"]["p90"] <= rep["wait_ms"]["p99"]
    assert abs(rep["wait_s"] + rep["compute_s"] + rep["other_s"] - rep["wall_s"]) < 1e-3
    assert len(rep["timeline"]["t_s"]) == len(rep["timeline"]["wait_fraction"]) > 0
    assert (tmp_path / "d.png").stat().st_size > 1000  # plot next to the JSON


def test_start_up_wait_is_reported_apart_from_the_steady_state():
    """A loader that takes 300 ms to deliver its first batch (a pipeline build), then 5 ms per batch."""
    def slow_start(n):
        time.sleep(0.3)
        for i in range(n):
            time.sleep(0.005)
            yield i

    d = Doctor(print_report=False)
    for _ in d.wrap(slow_start(10)):
        time.sleep(0.02)
    rep = d.finish()
    (e,) = rep["loaders"]
    assert 0.3 <= e["startup_wait_s"] < 0.5 and e["iterations"] == 1
    assert e["wait_fraction"] > 0.5  # over everything, start-up dominates
    assert 0.1 < e["steady_wait_fraction"] < 0.35  # after it: ~5 ms of ~25 ms per step


def test_manual_api_and_other_time():
    d = Doctor(print_report=False)
    with d:
        for _ in range(10):
            time.sleep(0.02)  # fetching
            d.data_ready()
            time.sleep(0.01)  # the step
            d.step()
    rep = d.finish()
    assert rep["steps"] == 10 and 0.5 < rep["wait_fraction"] < 0.8
    d2 = Doctor(print_report=False)
    for _ in d2.wrap(sleepy(10, 0.0)):
        time.sleep(0.01)
        d2.step()
        time.sleep(0.02)  # after step(): neither wait nor compute
    rep2 = d2.finish()
    assert rep2["steps"] == 10
    assert 0.5 < rep2["other_fraction"] < 0.8 and rep2["wait_fraction"] < 0.1


def test_wrap_reiterates_epochs():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(12.0)), batch_size=4)
    d = Doctor(print_report=False)
    wrapped = d.wrap(loader)
    assert len(wrapped) == 3
    for _ in range(2):
        for _ in wrapped:
            pass
    rep = d.finish()
    assert rep["steps"] == 6 and rep["loader"]["num_workers"] == 0 and rep["batch"]["batch_size"] == 4


def test_advice_from_a_real_loop():
    loader = torch.utils.data.DataLoader(SleepyDataset(8, 0.02), batch_size=1, num_workers=0)
    d = Doctor(print_report=False, probe_capacity=True, probe_seconds=0.2)
    for _ in d.wrap(loader):
        time.sleep(0.002)
    rep = d.finish()
    ids = [a["id"] for a in rep["advice"]]
    assert "more_workers" in ids and "not_bottleneck" not in ids
    cap = rep["rates"]["capacity_batches_per_s"]
    assert cap is not None and 0 < cap <= 55  # a 20 ms sleep per batch bounds it at 50/s
    assert "capacity" in ids  # the model consumes faster than the pipeline delivers
    fast = Doctor(print_report=False)
    for _ in fast.wrap([torch.zeros(2, 2)] * 8):  # data in hand: next() costs microseconds
        time.sleep(0.02)
    ids = [a["id"] for a in fast.finish()["advice"]]
    assert ids == ["not_bottleneck"]


def test_padding_advice_from_token_batches():
    def batches(pad_cols):
        for _ in range(4):
            mask = torch.ones(4, 10, dtype=torch.int64)
            if pad_cols:
                mask[:, -pad_cols:] = 0
            yield {"input_ids": torch.zeros(4, 10, dtype=torch.int64), "attention_mask": mask}

    d = Doctor(print_report=False)
    for _ in d.wrap(batches(5)):
        pass
    rep = d.finish()
    assert rep["batch"]["padding_fraction"] == pytest.approx(0.5)
    packing = [a for a in rep["advice"] if a["id"] == "packing"]
    assert packing and "50%" in packing[0]["advice"]
    d = Doctor(print_report=False)
    for _ in d.wrap(batches(1)):
        pass
    assert not [a for a in d.finish()["advice"] if a["id"] == "packing"]


def test_doctor_is_the_public_entry_point():
    d = doctor_report.doctor(print_report=False)
    assert isinstance(d, Doctor)


SCRIPT = """
import sys, time, torch
ds = torch.utils.data.TensorDataset(torch.arange(24.0))
for epoch in range(2):
    for (x,) in torch.utils.data.DataLoader(ds, batch_size=4):
        time.sleep(0.001)
import loaders
for (x,) in loaders.DataLoader(ds, batch_size=8):
    pass
sys.exit(int(sys.argv[1]))
"""


def test_cli_runs_script_and_propagates_exit_code(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "doc.json"
    argv = list(sys.argv)
    assert main(["doctor", "--json", str(out), "--", str(script), "3"]) == 3
    assert sys.argv == argv
    rep = json.loads(out.read_text())
    assert rep["steps"] == 2 * 6 + 3  # the loaders.DataLoader's inner torch loader is not counted twice
    assert [entry["batches"] for entry in rep["loaders"]] == [6, 6, 3]
    assert rep["loader"]["wait_s"] == max(entry["wait_s"] for entry in rep["loaders"])
    assert "datapipe doctor:" in capsys.readouterr().err
    assert main(["doctor", "--", str(script), "0"]) == 0
    assert main(["doctor", "--", "python", str(script), "4"]) == 4  # as other profilers take it
    assert main(["doctor", "--", sys.executable, str(script), "5"]) == 5
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    assert main(["doctor", "--", str(bad)]) == 1
    assert "boom" in capsys.readouterr().err
    assert main(["doctor", "--", str(tmp_path / "missing.py")]) == 1
    import torch.utils.data

    assert "patched" not in torch.utils.data.DataLoader.__iter__.__name__


@pytest.mark.gpu
def test_cuda_advice_on_pageable_batches():
    torch.zeros(1, device="cuda")  # CUDA initialised: the doctor synchronises at step ends
    d = Doctor(print_report=False)
    for x in d.wrap(sleepy(6, 0.01)):
        x.to("cuda").sum().item()
    rep = d.finish()
    assert rep["cuda"] and rep["cuda_sync"]
    assert "pin_memory" in [a["id"] for a in rep["advice"]]


def _fails_on_every_third(sample):
    if int(sample["cls"]) % 3 == 0:
        raise ValueError("bad sample")
    return sample["__key__"]


def test_the_loaders_losses_are_reported_when_there_are_any(tmp_path):
    """The losses a loader's stats() counts (skipped samples, handled errors) reach the report and one line of it."""
    from datapipe import ShardStream
    from datapipe.tools.doctor.report_text import format_report
    from loaders import DataLoader
    from tests.shards import write_shards

    urls, samples = write_shards(tmp_path / "d", [7, 5])
    bad = sum(int(s["cls"]) % 3 == 0 for s in samples)
    lossy = DataLoader(ShardStream(urls, on_error="skip").map(_fails_on_every_third), batch_size=2, collate_fn=list)
    d = Doctor(print_report=False)
    for _ in range(2):
        for _ in d.wrap(lossy):
            pass
    rep = d.finish()
    assert rep["loader"]["losses"] == {"skipped": 2 * bad, "errors": 2 * bad, "padded": 0}  # since it was made
    assert (f"  losses: DataLoader {2 * bad} samples skipped, {2 * bad} errors handled under on_error "
            "(since it was made)") in format_report(rep).splitlines()
    clean = Doctor(print_report=False)
    for _ in clean.wrap(DataLoader(ShardStream(urls), batch_size=4, collate_fn=list)):
        pass
    for _ in clean.wrap(torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2)):  # no stats(): no losses
        pass
    rep = clean.finish()
    assert [e["losses"] for e in rep["loaders"]] == [{"skipped": 0, "errors": 0, "padded": 0}, {}]
    assert "losses:" not in format_report(rep)


class _HoldingLoader:
    """Batches whose next() waits (as ImageLoader's step hold does), with stats() saying how long it held."""

    def __init__(self, batches: int, hold_s: float, reported_s: float):
        self.batches, self.hold_s, self.reported_s = batches, hold_s, reported_s

    def __iter__(self):
        for i in range(self.batches):
            time.sleep(self.hold_s)
            yield torch.full((2,), float(i))

    def stats(self):
        return {"step_hold": {"active": True, "seconds": self.reported_s}}


def test_time_next_waits_for_the_gpu_is_compute_not_data_wait():
    from datapipe.tools.doctor.report_text import format_report

    d = Doctor(print_report=False)
    for _ in d.wrap(_HoldingLoader(5, 0.02, reported_s=0.05)):  # next() waits >= 0.1 s, 0.05 s of it the hold
        pass
    rep = d.finish()
    assert rep["gpu_hold_s"] == 0.05
    plain = Doctor(print_report=False)
    for _ in plain.wrap(_HoldingLoader(5, 0.02, reported_s=0.0)):
        pass
    assert plain.finish()["gpu_hold_s"] == 0.0
    assert "waited for the GPU's last step" in format_report(rep)
    assert "GPU's last step" not in format_report(plain.finish())


def test_a_loader_that_moves_between_decoders_by_itself_is_seen_as_such():
    from types import SimpleNamespace

    from datapipe.tools.doctor.report import _decoder_moves

    def loader(setting, switchable):
        return SimpleNamespace(decode=SimpleNamespace(hw_decoder_load=setting),
                               stats=lambda: {"decoder": {"switchable": switchable}})

    assert _decoder_moves(loader("auto", False))
    assert _decoder_moves(loader(None, True))  # the default's CUDA decoder gives way when starved
    assert not _decoder_moves(loader(None, False)) and not _decoder_moves(loader(0.75, False))
    assert not _decoder_moves(SimpleNamespace())  # torch's DataLoader: no decoder at all


class _DecodingLoader:
    """Batches, and stats() with the decoder entry ImageLoader's has."""

    def __init__(self, decoder: dict):
        self.decoder = decoder

    def __iter__(self):
        return iter([torch.zeros(2)] * 3)

    def stats(self):
        return {"decoder": self.decoder}


def test_an_image_loaders_decoder_choice_is_one_line_of_a_cuda_report(monkeypatch):
    from datapipe.tools.doctor.report_text import format_report

    monkeypatch.setattr("datapipe.tools.doctor.report.step_kind", lambda: "eager")  # whatever ran before in this process

    chosen = {"hw_decoder_load": 0.0, "auto": False, "switchable": True, "threads": 12,
              "switched_after_batches": None, "switches": 0, "rebuild_s": 0.0}
    moved = {**chosen, "hw_decoder_load": 0.75, "threads": 8, "switched_after_batches": 13, "switches": 1,
             "batches_per_s": [17.5], "trial": "on"}
    kept = {**moved, "batches_per_s": [17.5, 19.25], "trial": "kept"}
    pending = {**moved, "batches_per_s": [17.5, 9.0], "trial": "moving back"}
    back = {**chosen, "switched_after_batches": 13, "switches": 2, "batches_per_s": [17.5, 9.0], "trial": "taken back"}
    graphs = {**kept, "hw_decoder_load": 0.1, "why": "cuda_graphs", "queues": 8}
    tried = "tried the hardware decoder after 13 batches (the loop was starved)"
    skip = "DecodeOptions(hw_decoder_load=0.0) skips the try and its one-off seconds)"
    for decoder, tail in ((chosen, "moves there by itself if the loop starves"),
                          (graphs, f"{tried} and kept it, not clearly slower there (17.5 -> 19.25 batches/s); "
                                   "step: eager; why: a CUDA-graphs step on 8 hardware queues: the CUDA decoder"),
                          (moved, f"{tried}, on trial"),
                          (kept, f"{tried} and kept it, not clearly slower there (17.5 -> 19.25 batches/s)"),
                          (pending, f"{tried} and moves back, slower there (17.5 -> 9 batches/s; {skip}"),
                          (back, f"{tried} and moved back, slower there (17.5 -> 9 batches/s; {skip}")):
        d = Doctor(print_report=False)
        for _ in d.wrap(_DecodingLoader(decoder)):
            pass
        rep = d.finish()
        assert rep["loader"]["decoder"] == decoder
        assert "decoder:" not in format_report({**rep, "cuda": False})  # no GPU: nothing decodes there
        (line,) = [x for x in format_report({**rep, "cuda": True, "cuda_device_max_connections": None}).splitlines()
                   if x.startswith("  decoder:")]
        share = f"{decoder['hw_decoder_load']:.0%}"
        assert line.startswith(f"  decoder: _DecodingLoader {share} of JPEGs on the hardware decoder, "
                               f"{decoder['threads']} DALI threads; {tail}")
        assert line.endswith("(CUDA_DEVICE_MAX_CONNECTIONS unset (8 queues))")


def test_cli_takes_python_options_and_modules_and_explains_launchers(tmp_path, monkeypatch, capsys):
    from datapipe.tools.doctor.cli import target

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    package = tmp_path / "proj"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert target("python3", ["-u", "-X", "dev", str(script), "1"]) == ("path", str(script), ["1"])
    assert target("python", ["-W", "ignore", "-m", "proj.train", "2"]) == ("module", "proj.train", ["2"])
    assert main(["doctor", "--", "python", "-u", str(script), "6"]) == 6
    assert main(["doctor", "--", "python", "-m", "proj.train", "7"]) == 7
    capsys.readouterr()
    assert main(["doctor", "--", "python", "-m", "proj.nothing"]) == 1
    assert "no such module: proj.nothing" in capsys.readouterr().err
    assert main(["doctor", "--", "ls", "train.py"]) == 1  # a program, not a script: say how instead
    err = capsys.readouterr().err
    assert "is a program or launcher" in err and "python -m" in err
    for launcher in (["torchrun", "--nproc-per-node", "2", "train.py"],  # on PATH or not
                     ["python", "-m", "torch.distributed.run", "train.py"]):
        assert main(["doctor", "--", *launcher]) == 1
        assert "is a program or launcher" in capsys.readouterr().err
    assert main(["doctor", "--", "python", "-m", "proj"]) == 1  # a package without __main__
    assert "package without a __main__ module" in capsys.readouterr().err
    assert main(["doctor", "--", "python", "-c", "print(1)"]) == 1
    assert "put the code in a script" in capsys.readouterr().err
