"""datapipe.tools.bench.peers: the rows on tiny data (a smoke test, no timing), the image folder, the budget."""
import json
import os
import time

import pytest

from datapipe.tools.bench import peers
from datapipe.tools.bench.peer_readers import one_epoch


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return peers.make_image_folder(str(tmp_path_factory.mktemp("peers") / "images"), num_images=24, num_classes=3,
                                   size=(48, 36))


def test_image_folder_lists_labels_by_sorted_class(source):
    items = peers.list_images(source)
    assert len(items) == 24
    labels = {os.path.basename(os.path.dirname(p)): label for p, _, label in items}
    assert sorted(labels, key=labels.get) == sorted(labels)
    assert len({key for _, key, _ in items}) == 24


def test_images_past_the_distinct_renders_are_other_files_of_the_same_pixels(tmp_path):
    import numpy as np

    from datapipe.tools.bench.baselines import decode_image

    folder = peers.make_image_folder(str(tmp_path / "img"), num_images=7, num_classes=2, size=(40, 30), distinct=3,
                                     workers=1)
    items = sorted(peers.list_images(folder), key=lambda x: x[1].split("/")[1])
    assert len(items) == 7 and not os.path.exists(folder + ".partial")
    data = [open(p, "rb").read() for p, _, _ in items]
    assert len(set(data)) == 7  # every file differs
    for i in range(3, 7):  # ... and decodes to its render's pixels, under its render's label
        assert np.array_equal(np.asarray(decode_image(data[i])), np.asarray(decode_image(data[i % 3])))
        assert items[i][2] == items[i % 3][2]
    with pytest.raises(ValueError, match="distinct"):
        peers.make_image_folder(str(tmp_path / "none"), num_images=3, distinct=0)


def _check_system(entry, *, resumable, own):
    assert entry["version"] and entry["how"]["format"]
    assert entry["write"]["images"] == 24, entry["write"]
    for epochs in entry["raw"].values():
        assert "error" not in epochs, epochs
        assert epochs["epoch1"]["samples"] == 24 and epochs["epoch2"]["samples"] == 24
        assert epochs["construct_first_batch_s"] >= epochs["epoch1"]["first_batch_s"] > 0
    dec = entry["decode"]
    assert "error" not in dec, dec
    assert dec["first_batch_s"] > 0 and dec["steady_samples"] == 24 - 6  # batches of 6 (see _run)
    if resumable:
        res = entry["resume"]
        assert "error" not in res, res
        assert res["exact"] is True and res["same_order"] is True, res
        assert res["resumed_samples"] == res["expected_samples"] == 24 - 6 * res["saved"]["stopped_after_batches"]
    else:
        assert entry["resume"] == {"error": "no mid-epoch resume"}
    if own:  # its own decoder: float CHW crops; 4 batches of 6, the first and the 2 made ahead of it not timed
        own_row = entry["decode_own"]
        assert "error" not in own_row, own_row
        assert own_row["steady_samples"] == 6 and own_row["batch_shape"] == [6, 3, 16, 16], own_row
        assert own_row["first_batch_s"] > 0 and "ImageLoader(device='cpu')" in own_row["did"]
    else:
        assert "decode_own" not in entry


def _run(source, tmp_path, systems):
    so_far = []
    res = peers.run_peers(source, work_dir=str(tmp_path / "work"), systems=systems, batch_size=8, workers=(0,),
                          decode_workers=0, resume_workers=0, image_size=16, timeout=240, decode_seconds=None,
                          progress=False, on_row=lambda r: so_far.append((r["partial"], len(r["table"]))))
    assert list(res["systems"]) == systems
    # a run cut short keeps what it measured: the result so far after every row, marked partial
    rows = len(systems) * 3 + len([s for s in systems if s in peers.RESUMABLE])  # write, raw, decode; resume
    rows += len([s for s in systems if s in peers.OWN_DECODERS])  # its own decoder
    assert so_far == [(True, len(res["table"]))] * rows
    assert "partial" not in res
    for system in systems:
        _check_system(res["systems"][system], resumable=system in peers.RESUMABLE, own=system in peers.OWN_DECODERS)
    assert res["source"]["images"] == 24 and res["settings"]["shuffle"] is True
    # 24 images are 3 batches of 8: smaller batches, so that a first batch is followed by more (and said so)
    assert res["settings"]["batch_size"] == 6 and "batches of 6 instead" in res["notes"][0]
    json.dumps(res)  # the result is JSON as it is
    return res


@pytest.mark.slow
def test_every_row_for_torch_webdataset_and_datapipe(source, tmp_path):
    res = _run(source, tmp_path, ["torch", "webdataset", "datapipe"])
    rows = {r["row"]: r for r in res["table"]}
    assert rows["mid-epoch resume, exact rest"] == {"row": "mid-epoch resume, exact rest", "torch": None,
                                                    "webdataset": None, "datapipe": True}
    assert all(rows["write, images/s"][s] > 0 for s in res["systems"])
    assert all(isinstance(rows["construct + first batch, 0 workers (s)"][s], float) for s in res["systems"])


def test_a_peer_not_installed_is_listed_not_measured(source, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "version", lambda system: None)
    res = peers.run_peers(source, work_dir=str(tmp_path / "w"), systems=["grain"], workers=(0,), progress=False)
    entry = res["systems"]["grain"]
    assert entry["version"] is None and "pip install -c constraints.txt" in entry["error"]
    assert peers.table_rows(res)[0]["grain"] == "n/a"


def test_rows_past_the_budget_say_so_and_the_run_ends(source, tmp_path):
    res = peers.run_peers(source, work_dir=str(tmp_path / "w"), systems=["torch"], workers=(0,), progress=False,
                          budget_s=0.5)
    entry = res["systems"]["torch"]
    assert entry["write"] == {"error": "not run: the run's budget of 0.5 s was spent"}
    assert "raw" not in entry and all(v is None for r in res["table"] for k, v in r.items() if k != "row")
    assert any("budget" in line for line in peers.run_notes(res))


def test_a_capped_epoch_stops_and_says_so():
    batches = [(["a", "b"], [b"x", b"y"], [0, 0])] * 5
    full = one_epoch(batches)
    assert full["samples"] == 10 and "capped" not in full
    cut = one_epoch(batches, cap_s=1e-9)
    assert cut["samples"] == 2 and cut["capped"] is True


def test_a_cut_epochs_rate_does_not_count_the_close_the_cut_makes():
    class SlowToClose:  # a loader whose iterator takes long to shut down (Grain's workers took ~100 s on a host)
        def __iter__(self):
            try:
                while True:
                    yield ["a"], [b"x"], [0]
            finally:
                time.sleep(0.5)

    cut = one_epoch(SlowToClose(), cap_s=0.05)
    assert cut["capped"] and cut["seconds"] < 0.4 and cut["close_s"] >= 0.5


def test_bad_arguments_say_what_to_choose(source):
    with pytest.raises(ValueError, match="choose from"):
        peers.run_peers(source, systems=["ffcv"])
    with pytest.raises(ValueError, match="no class folders"):
        peers.run_peers(source + "-missing")
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        peers.run_peers(source, budget_s=0)


def test_plot_draws_the_numeric_rows(tmp_path):
    pytest.importorskip("matplotlib")
    from datapipe.tools.plots import plot_peers

    result = {"systems": {"datapipe": {}, "litdata": {}}, "settings": {"batch_size": 8}, "source": {"images": 3},
              "table": [{"row": "write, images/s", "datapipe": 10.0, "litdata": 5.0},
                        {"row": "mid-epoch resume, exact rest", "datapipe": True, "litdata": None}]}
    path = plot_peers(result, str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_folder_from_shards_gives_every_system_the_same_images(tmp_path):
    from datapipe.tools.synthetic import make_image_dataset

    make_image_dataset(str(tmp_path / "shards"), num_images=10, num_classes=2, shard_max_count=4, size=(32, 24),
                       progress=False)
    from datapipe import expand_urls

    urls = expand_urls(str(tmp_path / "shards"))
    folder = peers.folder_from_shards(urls, str(tmp_path / "images"))
    assert len(peers.list_images(folder)) == 10


def test_a_run_cut_by_its_budget_goes_on_with_the_rows_it_left(source, tmp_path, monkeypatch):
    work = str(tmp_path / "w")
    kw = dict(work_dir=work, systems=["torch"], batch_size=8, workers=(0,), decode_workers=0, resume_workers=0,
              image_size=16, timeout=240, decode_seconds=None, progress=False)
    first = peers.run_peers(source, **kw)
    entry = first["systems"]["torch"]
    assert "error" not in entry["raw"]["0"] and "error" not in entry["decode"]
    cut = json.loads(json.dumps(first))  # as if its budget had stopped it before the decode row
    cut["systems"]["torch"]["decode"] = {"error": "not run: the run's budget of 1 s was spent"}
    cut["environment"] = {"date": "2026-12-06T06:00:00+00:00"}
    ran = []
    from datapipe.tools.bench import peer_process

    original = peer_process.RowRunner.run

    def counting(self, spec, **kw):
        ran.append(spec["row"])
        return original(self, spec, **kw)

    monkeypatch.setattr(peer_process.RowRunner, "run", counting)
    rest = peers.run_peers(source, **kw, earlier=cut)
    assert ran == ["decode"]  # the write, raw and resume rows were kept, with the format already written
    assert rest["systems"]["torch"]["raw"] == entry["raw"] and rest["systems"]["torch"]["write"] == entry["write"]
    assert "error" not in rest["systems"]["torch"]["decode"]
    assert rest["settings"]["continues"] == ["2026-12-06T06:00:00+00:00"]
    other = json.loads(json.dumps(cut))
    other["settings"]["batch_size"] = 4
    with pytest.raises(ValueError, match="other settings"):
        peers.run_peers(source, **kw, earlier=other)


def test_systems_run_one_after_another_and_their_formats_can_go(source, tmp_path):
    work = tmp_path / "w"
    order = []
    res = peers.run_peers(source, work_dir=str(work), systems=["torch", "datapipe"], batch_size=8, workers=(0,),
                          decode_workers=0, resume_workers=0, image_size=16, timeout=240, decode_seconds=None,
                          progress=False, drop_formats=True,
                          on_row=lambda r: order.append([s for s, e in r["systems"].items() if "decode" in e]))
    assert order[3] == ["torch"] and order[4] == ["torch"]  # torch's rows all came before datapipe's write
    for system in ("torch", "datapipe"):
        assert "error" not in res["systems"][system]["decode"]
        assert not (work / system).exists()  # its format went once its rows were done


def test_a_system_an_earlier_run_finished_is_kept_whole_even_with_its_format_gone(source, tmp_path, monkeypatch):
    kw = dict(work_dir=str(tmp_path / "w"), systems=["torch"], batch_size=8, workers=(0,), decode_workers=0,
              resume_workers=0, image_size=16, timeout=240, decode_seconds=None, progress=False)
    first = peers.run_peers(source, **kw, drop_formats=True)
    assert not (tmp_path / "w" / "torch").exists()
    from datapipe.tools.bench import peer_process

    ran = []
    monkeypatch.setattr(peer_process.RowRunner, "run", lambda self, spec, **k: ran.append(spec["row"]) or {})
    rest = peers.run_peers(source, **kw, earlier=json.loads(json.dumps(first)))
    assert ran == [] and rest["systems"]["torch"]["raw"] == first["systems"]["torch"]["raw"]


def test_a_continuation_over_fewer_systems_keeps_the_others(source, tmp_path, monkeypatch):
    kw = dict(work_dir=str(tmp_path / "w"), batch_size=8, workers=(0,), decode_workers=0, resume_workers=0,
              image_size=16, timeout=240, decode_seconds=None, progress=False)
    first = peers.run_peers(source, systems=["torch"], **kw)
    cut = json.loads(json.dumps(first))
    cut["systems"]["datapipe"] = {"version": "x", "write": {"error": "not run: the run's budget of 1 s was spent"}}
    partial = []
    rest = peers.run_peers(source, systems=["datapipe"], **kw, earlier=cut, on_row=partial.append)
    assert list(rest["systems"]) == ["torch", "datapipe"]  # the order of SYSTEMS, not of the call
    assert partial and all(p["systems"]["torch"] == first["systems"]["torch"] for p in partial)  # saved at each row
    assert rest["systems"]["torch"] == first["systems"]["torch"]
    assert "error" not in rest["systems"]["datapipe"]["raw"]["0"]


def test_a_continuation_keeps_the_own_decoder_row_of_a_system_it_finished(source, tmp_path, monkeypatch):
    kw = dict(work_dir=str(tmp_path / "w"), systems=["datapipe"], batch_size=8, workers=(0,), decode_workers=0,
              resume_workers=0, image_size=16, timeout=240, decode_seconds=None, progress=False)
    from datapipe.tools.bench import peer_process

    ran = []
    monkeypatch.setattr(peer_process.RowRunner, "run",
                        lambda self, spec, **k: ran.append(spec["row"]) or {"x": 1, "did": "d"})
    first = peers.run_peers(source, **kw)
    assert first["systems"]["datapipe"]["decode_own"] == {"x": 1, "did": "d"} and "decode_own" in ran
    ran.clear()
    rest = peers.run_peers(source, **kw, earlier=json.loads(json.dumps(first)))
    assert ran == [] and rest["systems"]["datapipe"]["decode_own"] == {"x": 1, "did": "d"}  # kept, not lost
    cut = json.loads(json.dumps(first))  # its budget stopped it before the own-decoder row: only that row runs
    cut["systems"]["datapipe"]["decode_own"] = {"error": "not run: the run's budget of 1 s was spent"}
    os.makedirs(tmp_path / "w" / "datapipe", exist_ok=True)  # its format, which the stand-in writer did not make
    rest = peers.run_peers(source, **kw, earlier=cut)
    assert ran == ["decode_own"] and rest["systems"]["datapipe"]["decode_own"] == {"x": 1, "did": "d"}
