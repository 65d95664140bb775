"""bench/ceiling.py's probe rows (--rows, imageloader@... variants), its profile's trace folder, and
bench/decoder_bound.py's settings and dmon averages."""
import time

import pytest

from bench import ceiling, decoder_bound


def test_variants_name_a_share_threads_and_no_hold():
    assert ceiling.variant("imageloader") == ("imageloader", {})
    assert ceiling.variant("imageloader@hw0.25+t14+nohold") == ("imageloader", {"hw": 0.25, "threads": 14,
                                                                                 "hold": False})
    assert ceiling.variant("imageloader@q4") == ("imageloader", {"depth": 4})
    assert ceiling.variant("imageloader@e15") == ("imageloader", {"early": 0.15})
    assert ceiling.variant("imageloader@hw0.5+s1") == ("imageloader", {"hw": 0.5, "slack": 1})
    assert ceiling.variant("imageloader@hw0.75+nohold+p3") == ("imageloader", {"hw": 0.75, "hold": False, "pad": 3})
    assert ceiling.fmt_of("imageloader@t14") == "images" and ceiling.fmt_of("tokenloader") == "tokens"
    with pytest.raises(ValueError, match="unknown option"):
        ceiling.variant("imageloader@fast")
    with pytest.raises(ValueError, match="imageloader only"):
        ceiling.variant("dali@t4")


def test_an_early_move_probe_keeps_the_default_choice_and_lowers_its_early_bar(monkeypatch):
    from types import SimpleNamespace

    import loaders

    made = []

    class FakeImageLoader:
        def __init__(self, source, **kwargs):
            made.append(kwargs)
            self._hold = SimpleNamespace(active=True)
            self._decoder = SimpleNamespace(early_threshold=0.30)

        def __iter__(self):
            return iter(())

    monkeypatch.setattr(loaders, "ImageLoader", FakeImageLoader)
    args = SimpleNamespace(device="cpu", batch_size=8, image_size=32)
    _, loader = ceiling.make_feed("imageloader@e15", args, {"images": "x"})
    assert made[0]["decode"] is None and made[0]["read"] is None  # the defaults, as a plain imageloader row
    assert loader._decoder.early_threshold == 0.15 and loader._hold.active
    _, loader = ceiling.make_feed("imageloader@t14+e20+nohold", args, {"images": "x"})
    assert made[1]["decode"].num_threads == 14 and loader._decoder.early_threshold == 0.2 and not loader._hold.active


def test_rows_replace_the_plan_and_bad_ones_are_refused():
    args = ceiling.parse(["--rows", "cuda_graphs/imageloader@t14,eager/dali/waits_each_step"])
    assert ceiling.plan(args) == [("cuda_graphs", "imageloader@t14", "runs_ahead"),
                                  ("eager", "dali", "waits_each_step")]
    assert args.loaders == ["dali", "imageloader@t14"]
    assert ceiling.parse(["--loaders", "imageloader@hw0.5,dali"]).loaders == ["imageloader@hw0.5", "dali"]
    for bad in (["--rows", "eager/nope"], ["--rows", "fast/dali"], ["--rows", "eager/imageloader@x1"],
                ["--profile-configs", "warp"], ["--loaders", "dali@t4"]):
        with pytest.raises(SystemExit):
            ceiling.parse(bad)


def test_the_profile_makes_its_trace_folder(tmp_path):
    import torch

    args = ceiling.parse(["--device", "cpu", "--warmup", "1"])
    folder = tmp_path / "not" / "made"
    events = ceiling.profile_window(ceiling.replay((torch.ones(4),)), lambda b: b[0] * 2, args, 2, str(folder), "x")
    assert (folder / "trace_x.json").exists() and isinstance(events, list)


def test_decoder_bound_settings_and_dmon_means():
    assert decoder_bound.parse_settings("0.0/12,0.5/14") == [(0.0, 12), (0.5, 14)]
    for bad in ("0.5", "1.5/8", "0.5/0", "a/b"):
        with pytest.raises(ValueError, match="share"):
            decoder_bound.parse_settings(bad)
    t = time.mktime(time.strptime("2026-12-03 10:00:00", "%Y-%m-%d %H:%M:%S"))
    lines = ["#Time gpu sm mem enc dec jpg ofa", "#HH:MM:SS Idx % % % % % %",
             "10:00:00 0 50 3 0 0 40 0", "10:00:01 0 70 3 0 0 - 0", "10:00:05 0 99 3 0 0 99 0"]
    means = decoder_bound.dmon_means(lines, t, t + 2)  # the third sample lies after the window
    assert means["sm"] == 60.0 and means["jpg"] == 40.0 and "gpu" not in means


def test_decoder_bound_times_the_nvimg_probe_and_closes_it(monkeypatch):
    """``--nvimg``'s rows: the probe feed made with the option set's options, timed like ImageLoader, then closed."""
    from bench import nvimg_feed

    made = []

    class Feed:
        def __init__(self, urls, *, batch_size, image_size, device, opts):
            made.append({"urls": urls, "batch_size": batch_size, "opts": opts, "closed": False})

        def close(self):
            made[-1]["closed"] = True

    monkeypatch.setattr(nvimg_feed, "NvImgFeed", Feed)
    monkeypatch.setattr(decoder_bound, "timed", lambda it, batches, warmup: (512, 2.0, 100.0))
    r = decoder_bound.measure_nvimg(["a.tar"], "stream+q4", batches=2, warmup=1, batch_size=256, image_size=224)
    assert r == {"nvimg": "stream+q4", "images_per_s": 256.0, "seconds": 2.0, "t0": 100.0, "t1": 102.0}
    assert made == [{"urls": ["a.tar"], "batch_size": 256, "opts": {"stream": True, "depth": 4}, "closed": True}]
    assert decoder_bound.parse_settings("") == []  # --settings "": the probe alone
