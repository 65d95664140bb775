"""datapipe.tools.bench.peers: every row for every installed system on tiny data (a smoke test, no timing)."""
import json
import os

import pytest

from datapipe.tools.bench import peers

PEERS = [s for s in ("litdata", "mosaicml") if peers.version(s) is not None]


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


def _check_system(entry, *, resumable):
    assert entry["version"]
    assert entry["write"]["images"] == 24 and entry["write"]["images_per_s"] > 0, entry["write"]
    for epochs in entry["raw"].values():
        assert "error" not in epochs, epochs
        assert epochs["epoch1"]["samples"] == 24 and epochs["epoch2"]["samples"] == 24
    dec = entry["decode"]
    assert "error" not in dec, dec
    assert dec["first_batch_s"] > 0 and dec["steady_samples"] == 24 - 6  # batches of 6 (see _run)
    if resumable:
        res = entry["resume"]
        assert "error" not in res, res
        assert res["exact"] is True, res
        assert res["resumed_samples"] == res["expected_samples"] == 24 - 6 * res["saved"]["stopped_after_batches"]
    else:
        assert entry["resume"] == {"error": "no mid-epoch resume"}


def _run(source, tmp_path, systems):
    so_far = []
    res = peers.run_peers(source, work_dir=str(tmp_path / "work"), systems=systems, batch_size=8, workers=(0,),
                          decode_workers=0, image_size=16, timeout=240, progress=False,
                          on_system=lambda r: so_far.append((list(r["systems"]), r["partial"], len(r["table"]))))
    assert list(res["systems"]) == systems
    # a run cut short keeps what it measured: the result so far after each system, marked partial
    assert so_far == [(systems[:i + 1], True, len(res["table"])) for i in range(len(systems))]
    assert "partial" not in res
    for system in systems:
        _check_system(res["systems"][system], resumable=system in peers.RESUMABLE)
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


@pytest.mark.slow
@pytest.mark.parametrize("system", ["litdata", "mosaicml"])
def test_every_row_for_a_peer_when_the_extra_is_installed(source, tmp_path, system):
    if peers.version(system) is None:
        pytest.skip(f"{system} is not installed (the peers extra: pip install 'datapipe[peers]')")
    res = _run(source, tmp_path, ["datapipe", system])
    assert res["systems"][system]["resume"]["exact"] is True


@pytest.mark.skipif(PEERS, reason="the peers are installed here: the other test measures them")
def test_a_peer_not_installed_is_listed_not_measured(source, tmp_path):
    res = peers.run_peers(source, work_dir=str(tmp_path / "w"), systems=["litdata"], workers=(0,), progress=False)
    entry = res["systems"]["litdata"]
    assert entry["version"] is None and "datapipe[peers]" in entry["error"]
    assert peers.table_rows(res)[0]["litdata"] == "n/a"


def test_bad_arguments_say_what_to_choose(source):
    with pytest.raises(ValueError, match="choose from"):
        peers.run_peers(source, systems=["ffcv"])
    with pytest.raises(ValueError, match="no class folders"):
        peers.run_peers(source + "-missing")


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



