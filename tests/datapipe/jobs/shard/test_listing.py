import json

import pytest

from datapipe import ShardStream
from datapipe.cli import main
from datapipe.jobs.shard.listing import detect_kind, make_key
from datapipe.jobs.shard.readers import iter_partition
from datapipe.jobs.shard.sources import open_source
from datapipe.tools.synthetic import iter_image_samples


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


def _write_list(path, rows):
    """A CSV (rows: lines) or JSONL (rows: records) list file."""
    if str(path).endswith(".csv"):
        path.write_text("\n".join(rows) + "\n")
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


# a list with labels: rows 3, 4 and 5 have an empty label, none at all, or a label but no path
LABELED = {
    "list.csv": ["path,label", "a/x.jpg,cat", "b/y.jpg,", "c/z.jpg", ",bird", "d/w.jpg,dog"],
    "list.jsonl": [{"path": "a/x.jpg", "label": "cat"}, {"path": "b/y.jpg", "label": ""}, {"path": "c/z.jpg"},
                   {"path": "", "label": "bird"}, {"path": "d/w.jpg", "label": "dog"}],
}


@pytest.mark.parametrize("name", sorted(LABELED))
def test_list_rows_without_label_or_path_are_skipped_with_a_record(tmp_path, name):
    _write_list(tmp_path / name, LABELED[name])
    src = open_source(str(tmp_path / name))
    items = src.partitions[0]["items"]
    assert [(i[1], i[2]) for i in items] == [(0, "a/x"), (1, "d/w")]
    assert src.classes == ["cat", "dog"]  # "bird" is only on a skipped row
    first = 2 if name.endswith(".csv") else 1  # a CSV's header is its line 1
    assert [s["item"] for s in src.skipped] == [f"{tmp_path / name}:{first + n}" for n in (1, 2, 3)]
    errors = [s["error"] for s in src.skipped]
    assert "b/y.jpg" in errors[0] and "empty 'label'" in errors[0]
    assert "c/z.jpg" in errors[1] and "missing 'label'" in errors[1]
    assert "'path'" in errors[2]


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
def test_list_integer_labels_come_from_the_kept_rows(tmp_path, name):
    rows = (["path,label", "a.jpg,3", "b.jpg,1", ",bird", "c.jpg,"] if name.endswith(".csv") else
            [{"path": "a.jpg", "label": 3}, {"path": "b.jpg", "label": "1"}, {"path": None, "label": "bird"},
             {"path": "c.jpg", "label": None}])
    _write_list(tmp_path / name, rows)
    src = open_source(str(tmp_path / name))
    assert src.classes is None and [i[1] for i in src.partitions[0]["items"]] == [3, 1]
    assert len(src.skipped) == 2


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
def test_labels_mixing_indices_and_names_are_names_and_say_so(tmp_path, name, caplog):
    rows = (["path,label", "a.jpg,10", "b.jpg,2", "c.jpg,cat"] if name.endswith(".csv") else
            [{"path": "a.jpg", "label": 10}, {"path": "b.jpg", "label": 2}, {"path": "c.jpg", "label": "cat"}])
    _write_list(tmp_path / name, rows)
    with caplog.at_level("WARNING", logger="datapipe"):
        src = open_source(str(tmp_path / name))
    assert src.classes == ["10", "2", "cat"] and [i[1] for i in src.partitions[0]["items"]] == [0, 1, 2]
    assert any("mix class indices (2 rows, e.g. '10') and names (1 row, e.g. 'cat')" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
def test_list_without_a_label_column_gives_unlabeled_samples(tmp_path, name):
    rows = ["path", "a/x.jpg", "b/y.jpg"] if name.endswith(".csv") else [{"path": "a/x.jpg"}, {"path": "b/y.jpg"}]
    _write_list(tmp_path / name, rows)
    src = open_source(str(tmp_path / name))
    assert src.classes is None and src.skipped == []
    assert [(i[1], i[2]) for i in src.partitions[0]["items"]] == [(None, "a/x"), (None, "b/y")]


@pytest.mark.parametrize("name", ["l.csv", "l.jsonl"])
def test_shard_list_with_unlabeled_rows_reports_them_and_strict_fails(tmp_path, name):
    """The user trial: rows without a label are skipped and listed, never written without ``cls``."""
    for i, s in enumerate(iter_image_samples(3, num_classes=1, size=(20, 16))):
        (tmp_path / "photos").mkdir(exist_ok=True)
        (tmp_path / "photos" / f"{i}.jpg").write_bytes(s["jpg"])
    rows = (["path,label", "photos/0.jpg,cat", "photos/1.jpg,", "photos/2.jpg", ",bird"] if name.endswith(".csv")
            else [{"path": "photos/0.jpg", "label": "cat"}, {"path": "photos/1.jpg", "label": ""},
                  {"path": "photos/2.jpg"}, {"path": "", "label": "bird"}])
    _write_list(tmp_path / name, rows)
    out = tmp_path / "out"
    assert main(["shard", str(tmp_path / name), str(out), "--workers", "1", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["samples"] == 1 and report["num_skipped"] == 3 and len(report["skipped"]) == 3
    assert json.loads((out / "manifest.json").read_text())["num_skipped"] == 3
    assert json.loads((out / "classes.json").read_text()) == ["cat"]
    samples = list(ShardStream(str(out)))
    assert [(s["__key__"], s["cls"]) for s in samples] == [("photos/0", b"0")]
    strict = tmp_path / "strict"
    assert main(["shard", str(tmp_path / name), str(strict), "--strict", "--no-progress"]) == 1
    assert not (strict / "manifest.json").exists()


@pytest.mark.parametrize("name, first", [("list.csv", "label,path"), ("list.csv", "path,label"),
                                         ("list.jsonl", None)])
def test_a_byte_order_mark_and_spaces_around_labels_change_nothing(tmp_path, name, first):
    """Spreadsheets save lists with a UTF-8 byte-order mark; a label is one class with or without spaces around."""
    if name.endswith(".csv"):
        cols = first.split(",")
        rows = [dict(path=p, label=lab) for p, lab in (("a.jpg", " cat"), ("b.jpg", "cat "), ("c.jpg", "dog"))]
        text = "\n".join([first] + [",".join(r[c] for c in cols) for r in rows]) + "\n"
    else:
        text = "\n".join(json.dumps({"path": p, "label": lab}) for p, lab in
                         (("a.jpg", " cat"), ("b.jpg", "cat "), ("c.jpg", "dog"))) + "\n"
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    src = open_source(str(tmp_path / name))
    assert src.classes == ["cat", "dog"] and [i[1] for i in src.partitions[0]["items"]] == [0, 0, 1]
    assert src.skipped == []


# JSONL labels that are neither a class name (a string) nor a class index (an integer): each such row is skipped
# with a record (never written with ``str(label)`` as a class name); the integer and string rows keep working
ODD_LABELS = [(["cat", "dog"], "a list"), ({"x": 1}, "an object"), (True, "a boolean"), (1.5, "a float"),
              (3.0, "a float")]


def test_jsonl_labels_that_are_not_a_name_or_an_integer_are_skipped_with_a_record(tmp_path):
    rows = [{"path": "a.jpg", "label": "cat"}] + [{"path": f"odd{i}.jpg", "label": lab}
                                                  for i, (lab, _) in enumerate(ODD_LABELS)]
    rows.append({"path": "b.jpg", "label": "dog"})
    _write_list(tmp_path / "list.jsonl", rows)
    src = open_source(str(tmp_path / "list.jsonl"))
    assert src.classes == ["cat", "dog"]
    assert [(i[1], i[2]) for i in src.partitions[0]["items"]] == [(0, "a"), (1, "b")]
    assert [s["item"] for s in src.skipped] == [f"{tmp_path / 'list.jsonl'}:{n}" for n in range(2, 2 + len(ODD_LABELS))]
    for s, (lab, kind) in zip(src.skipped, ODD_LABELS):
        assert f"'label' is {kind}" in s["error"] and json.dumps(lab) in s["error"], s


def test_jsonl_integer_labels_keep_working_beside_a_bad_label(tmp_path):
    """A float beside integer labels once turned every label into a class name (3 -> '3', sorted as text)."""
    _write_list(tmp_path / "list.jsonl", [{"path": "a.jpg", "label": 3}, {"path": "b.jpg", "label": 10},
                                          {"path": "c.jpg", "label": 2.5}, {"path": "d.jpg", "label": "1"},
                                          {"path": "e.jpg", "label": False}])
    src = open_source(str(tmp_path / "list.jsonl"))
    assert src.classes is None and [i[1] for i in src.partitions[0]["items"]] == [3, 10, 1]
    assert [s["item"].rsplit(":", 1)[1] for s in src.skipped] == ["3", "5"]


@pytest.mark.parametrize("label", [["cat", "dog"], {"x": 1}])
def test_shard_list_with_a_list_or_object_label_reports_it_and_strict_fails(tmp_path, label):
    """The user trial: {"label": ["cat", "dog"]} was written as the class "['cat', 'dog']"."""
    (tmp_path / "photos").mkdir()
    for i, s in enumerate(iter_image_samples(2, num_classes=1, size=(20, 16))):
        (tmp_path / "photos" / f"{i}.jpg").write_bytes(s["jpg"])
    _write_list(tmp_path / "l.jsonl", [{"path": "photos/0.jpg", "label": "cat"},
                                       {"path": "photos/1.jpg", "label": label}])
    out = tmp_path / "out"
    assert main(["shard", str(tmp_path / "l.jsonl"), str(out), "--workers", "1", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["samples"] == 1 and report["num_skipped"] == 1
    assert "photos/1.jpg" in report["skipped"][0]["error"]
    assert json.loads((out / "classes.json").read_text()) == ["cat"]
    assert [(s["__key__"], s["cls"]) for s in ShardStream(str(out))] == [("photos/0", b"0")]
    strict = tmp_path / "strict"
    assert main(["shard", str(tmp_path / "l.jsonl"), str(strict), "--strict", "--no-progress"]) == 1
    assert not (strict / "manifest.json").exists()
