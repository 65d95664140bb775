import json

from datapipe.jobs.shard.listing import detect_kind, make_key
from datapipe.jobs.shard.readers import iter_partition
from datapipe.jobs.shard.sources import open_source


def test_make_key_drops_extension_and_odd_characters():
    assert make_key("cat/img.001.jpg") == "cat/img_001"
    assert make_key("dog/a b.png") == "dog/a_b"
    assert make_key("noext") == "noext"


def test_detect_kind(tmp_path):
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "a" / "x.jpg").write_bytes(b"x")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "t.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "list.jsonl").write_text('{"path": "a/x.jpg", "label": 1}\n')
    assert detect_kind(str(tmp_path / "imgs")) == "images"
    assert detect_kind(str(tmp_path / "texts")) == "text"
    assert detect_kind(str(tmp_path / "texts" / "t.jsonl")) == "text"
    assert detect_kind(str(tmp_path / "list.jsonl")) == "list"
    assert detect_kind(str(tmp_path / "x.csv")) == "list"
    assert detect_kind(str(tmp_path / "s-{0..3}.tar")) == "tar"


def test_image_folder_listing(tmp_path):
    for rel in ["b/2.jpg", "a/1.JPEG", "a/notes.txt", "c/.hidden.jpg", "stray.png"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(rel.encode())
    src = open_source(str(tmp_path), partition_size=1)
    assert src.kind == "images" and src.classes == ["a", "b", "c"]
    assert src.num_items == 2 and len(src.partitions) == 2
    records = [r for p in src.partitions for r in iter_partition(p)]
    assert [r.sample["__key__"] for r in records] == ["a/1", "b/2"]
    assert records[0].sample["jpg"] == b"a/1.JPEG" and records[0].sample["cls"] == b"0"
    skipped = {s["item"].rsplit("/", 1)[-1]: s["error"] for s in src.skipped}
    assert set(skipped) == {"stray.png", "c"}  # outside class folders; class folder without images


def test_list_labels_and_paths(tmp_path):
    (tmp_path / "list.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"path": "x/1.png", "label": "zebra"}, {"path": "x/2.png", "label": "ant"}, "not json"]) + "\n")
    src = open_source(str(tmp_path / "list.jsonl"))
    assert src.classes == ["ant", "zebra"]
    items = src.partitions[0]["items"]
    assert [(i[1], i[2], i[3]) for i in items] == [(1, "x/1", "png"), (0, "x/2", "png")]
    assert items[0][0] == str(tmp_path / "x" / "1.png")
    assert len(src.skipped) == 1 and "list.jsonl:3" in src.skipped[0]["item"]
    records = list(iter_partition(src.partitions[0]))
    assert all(r.sample is None and "cannot read" in r.error for r in records)  # files do not exist
