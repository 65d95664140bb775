import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
import webdataset
from PIL import Image

from datapipe import ShardStream
from datapipe.cli import main
from datapipe.jobs.shard.job import shard
from datapipe.jobs.shard.options import ImageOptions, ShardOptions, TextOptions
from datapipe.tools.synthetic import iter_image_samples
from tests.shards import write_shards

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


_IMAGE = {"check_images": "check", "resize": "resize", "quality": "quality"}
_TEXT = ("text_field", "key_field", "tokenizer")


def run_shard(src, out, *, engine="local", workers=1, progress=False, **flat):
    """``shard(src, out, ShardOptions(...))`` from flat option names (the CLI's), for short tests."""
    images = ImageOptions(**{_IMAGE[k]: flat.pop(k) for k in list(flat) if k in _IMAGE})
    text = TextOptions(**{k: flat.pop(k) for k in list(flat) if k in _TEXT})
    return shard(str(src), str(out), ShardOptions(images=images, text=text, **flat), engine=engine, workers=workers,
                 progress=progress)


def make_image_folder(root, n=24, classes=("cat", "dog", "emu"), size=(40, 30)):
    """Real JPEGs in class sub-folders; returns {relative path: bytes}."""
    files = {}
    for i, s in enumerate(iter_image_samples(n, num_classes=1, size=size)):
        rel = f"{classes[i % len(classes)]}/img.{i:03d}.jpg"
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(s["jpg"])
        files[rel] = s["jpg"]
    return files


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    return str(root), make_image_folder(str(root))


def read_all(out):
    """Samples of a shard folder via webdataset, in shard order, keyed by __key__."""
    names = sorted(n for n in os.listdir(out) if n.endswith(".tar"))
    ds = webdataset.WebDataset([os.path.join(out, n) for n in names], shardshuffle=False)
    return [{k: v for k, v in s.items() if k != "__url__" and k != "__local_path__"} for s in ds]


def run_cli(*args):
    return main(["shard", *map(str, args), "--no-progress"])


def test_image_folder_to_shards(images, tmp_path):
    root, files = images
    out = str(tmp_path / "out")
    report = run_shard(root, out, max_count=5, partition_size=7, workers=1, progress=False)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["num_samples"] == len(files) == report["samples"]
    assert manifest["classes"] == ["cat", "dog", "emu"]
    assert json.load(open(os.path.join(out, "classes.json"))) == ["cat", "dog", "emu"]
    names = [s["name"] for s in manifest["shards"]]
    assert names == [f"shard-{i:06d}.tar" for i in range(len(names))]  # dense
    assert all(s["count"] <= 5 for s in manifest["shards"])
    samples = read_all(out)
    assert len(samples) == len(files)
    by_key = {s["__key__"]: s for s in samples}
    for rel, data in files.items():
        key = rel[: -len(".jpg")].replace(".", "_")
        assert by_key[key]["jpg"] == data
        assert int(by_key[key]["cls"]) == ["cat", "dog", "emu"].index(rel.split("/")[0])
    # datapipe's own reader agrees, with counts from the manifest
    stream = ShardStream(os.path.join(out, "shard-{000000..%06d}.tar" % (len(names) - 1)))
    assert len(stream) == len(files)
    assert sorted(s["__key__"] for s in stream) == sorted(by_key)
    assert not os.path.exists(os.path.join(out, ".datapipe-job", "parts"))


def test_output_independent_of_workers_and_deterministic(images, tmp_path):
    root, _ = images
    a = run_shard(root, str(tmp_path / "a"), max_count=4, partition_size=5, workers=1, shuffle=True, seed=3,
              progress=False)
    b = run_shard(root, str(tmp_path / "b"), max_count=4, partition_size=5, workers=2, shuffle=True, seed=3,
              progress=False)
    assert a["samples"] == b["samples"]
    ma = json.load(open(tmp_path / "a" / "manifest.json"))["shards"]
    mb = json.load(open(tmp_path / "b" / "manifest.json"))["shards"]
    assert ma == mb  # same names, counts and sha256: byte-identical shards


def test_shuffle_is_seeded_and_keeps_the_sample_set(images, tmp_path):
    root, files = images
    order = {}
    for name, kw in {"plain": {}, "s1": dict(shuffle=True, seed=1), "s1b": dict(shuffle=True, seed=1),
                     "s2": dict(shuffle=True, seed=2)}.items():
        run_shard(root, str(tmp_path / name), partition_size=6, workers=1, progress=False, **kw)
        order[name] = [s["__key__"] for s in read_all(str(tmp_path / name))]
    assert order["s1"] == order["s1b"]
    assert order["s1"] != order["plain"] and order["s1"] != order["s2"]
    assert sorted(order["s1"]) == sorted(order["plain"]) == sorted(order["s2"])
    assert len(order["plain"]) == len(files)


def test_resize_and_reencode(images, tmp_path):
    root, files = images
    report = run_shard(root, str(tmp_path / "out"), resize=16, quality=70, index=True, workers=1, progress=False)
    assert report["samples"] == len(files)
    for s in read_all(str(tmp_path / "out")):
        im = Image.open(io.BytesIO(s["jpg"]))
        assert im.format == "JPEG" and min(im.size) == 16
    assert os.path.exists(tmp_path / "out" / "shard-000000.idx")
    first = open(tmp_path / "out" / "shard-000000.idx").readline().split()
    assert first[0] == "v1.2" and int(first[1]) == json.load(open(tmp_path / "out" / "manifest.json"))["shards"][0]["count"]


def test_bad_images_skipped_or_strict(tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=6, classes=("a", "b"))
    (root / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "empty_class").mkdir()
    out = tmp_path / "out"
    assert run_cli(root, out, "--check-images", "--workers", "1") == 0
    report = json.load(open(out / "report.json"))
    assert report["samples"] == 6 and report["num_skipped"] == 2
    assert json.load(open(out / "manifest.json"))["num_skipped"] == 2
    skipped = " ".join(s["item"] for s in report["skipped"])
    assert "broken.jpg" in skipped and "empty_class" in skipped
    os.rmdir(root / "empty_class")
    code = run_cli(root, tmp_path / "strict", "--check-images", "--strict", "--workers", "2")
    assert code == 1
    failure = json.load(open(tmp_path / "strict" / "report.json"))
    assert failure["status"] == "failed" and "broken.jpg" in failure["error"]
    assert not os.path.exists(tmp_path / "strict" / "manifest.json")


def test_csv_list_with_missing_file(images, tmp_path):
    root, files = images
    lines = ["path,label"] + [f"{os.path.join(root, rel)},{rel.split('/')[0]}" for rel in sorted(files)[::5]]
    lines.append("nowhere/missing.jpg,cat")
    (tmp_path / "list.csv").write_text("\n".join(lines) + "\n")
    report = run_shard(str(tmp_path / "list.csv"), str(tmp_path / "out"), workers=1, progress=False)
    assert report["samples"] == 5 and report["num_skipped"] == 1
    assert "missing.jpg" in report["skipped"][0]["item"]
    manifest = json.load(open(tmp_path / "out" / "manifest.json"))
    labels = {int(s["cls"]) for s in read_all(str(tmp_path / "out"))}
    assert manifest["classes"] == ["cat", "dog", "emu"] and labels <= {0, 1, 2}
    assert run_cli(tmp_path / "list.csv", tmp_path / "strict", "--strict", "--workers", "1") == 1


def write_jsonl(path, texts, bad_line=True):
    with open(path, "wb") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"doc{i}", "text": t}).encode() + b"\n")
            if bad_line and i == 3:
                f.write(b'{"text": "caf\xe9 latin-1"}\n')  # not UTF-8


def test_jsonl_text_with_byte_tokenizer(tmp_path):
    texts = [f"document {i} " + "héllo wörld " * (i % 5) for i in range(40)]
    write_jsonl(tmp_path / "docs.jsonl", texts)
    report = run_shard(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), tokenizer="byte", partition_bytes=300,
                   max_count=8, workers=2, progress=False)
    assert report["partitions"] > 3
    assert report["samples"] == 40 and report["num_skipped"] == 1
    assert "not UTF-8" in report["skipped"][0]["error"]
    samples = sorted(read_all(str(tmp_path / "out")), key=lambda s: s["__key__"])  # keys: file, byte offset
    got = [s["txt"].decode() for s in samples]
    assert got == texts  # every line exactly once across byte-range partitions
    for s in samples:
        ids = np.load(io.BytesIO(s["npy"]))
        assert ids.dtype == np.int32 and bytes(ids.astype(np.uint8)) == s["txt"]
    assert run_cli(tmp_path / "docs.jsonl", tmp_path / "strict", "--strict", "--workers", "1") == 1


def test_jsonl_key_field_and_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "data": 3}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    write_jsonl(tmp_path / "d.jsonl", ["hello world", "data data hello", "what"], bad_line=False)
    run_shard(str(tmp_path / "d.jsonl"), str(tmp_path / "out"), tokenizer=str(tmp_path / "tok.json"), key_field="id",
          shuffle=False, workers=1, progress=False)
    samples = read_all(str(tmp_path / "out"))
    assert [s["__key__"] for s in samples] == ["doc0", "doc1", "doc2"]
    assert [np.load(io.BytesIO(s["npy"])).tolist() for s in samples] == [[1, 2], [3, 3, 1], [0]]


def test_parquet_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}" for i in range(25)]
    pq.write_table(pa.table({"body": texts, "n": list(range(25))}), tmp_path / "t.parquet", row_group_size=10)
    report = run_shard(str(tmp_path / "t.parquet"), str(tmp_path / "out"), text_field="body", shuffle=False, workers=1,
                       progress=False)
    assert report["partitions"] == 3 and report["samples"] == 25
    assert [s["txt"].decode() for s in read_all(str(tmp_path / "out"))] == texts


def test_reshard_tars_and_truncated_tar(tmp_path):
    urls, samples = write_shards(tmp_path / "in", [10, 3, 0, 8, 5], manifest=False)
    report = run_shard(str(tmp_path / "in"), str(tmp_path / "out"), max_count=12, workers=2, progress=False)
    assert report["samples"] == 26
    counts = [s["count"] for s in json.load(open(tmp_path / "out" / "manifest.json"))["shards"]]
    assert sum(counts) == 26 and max(counts) <= 12 and len(counts) < 5  # small inputs merged into bigger shards
    got = {s["__key__"]: s for s in read_all(str(tmp_path / "out"))}
    assert {k: (v["bin"], v["cls"]) for k, v in got.items()} == {s["__key__"]: (s["bin"], s["cls"]) for s in samples}
    # truncate the first shard in the middle of its data
    data = open(urls[0], "rb").read()
    with open(urls[0], "wb") as f:
        f.write(data[: len(data) // 2 + 100])
    report = run_shard(str(tmp_path / "in"), str(tmp_path / "out2"), workers=1, progress=False)
    assert 16 <= report["samples"] < 26 and report["num_skipped"] >= 1
    assert "shard-000000.tar" in report["skipped"][-1]["item"] or "shard-000000.tar" in str(report["skipped"])
    assert run_cli(tmp_path / "in", tmp_path / "strict", "--strict", "--workers", "1") == 1


def test_fsspec_destination(images):
    import fsspec

    root, files = images
    report = run_shard(root, "memory://dp-test/out", max_count=10, workers=1, progress=False)
    fs = fsspec.filesystem("memory")
    manifest = json.loads(fs.cat("/dp-test/out/manifest.json"))
    assert manifest["num_samples"] == len(files) == report["samples"]
    keys = set()
    for s in manifest["shards"]:
        with tarfile.open(fileobj=io.BytesIO(fs.cat(f"/dp-test/out/{s['name']}"))) as t:
            keys |= {m.name.split(".")[0] for m in t.getmembers() if not m.name.startswith(".")}  # no member table
    assert len(keys) == len(files)


def _complete_tar(path):
    with tarfile.open(path) as t:
        return len(t.getmembers())


def test_sigkill_and_rerun_matches_uninterrupted(tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=150, classes=("a", "b", "c", "d"), size=(96, 72))
    args = [str(root), "--resize", "40", "--max-count", "4", "--partition-size", "6", "--workers", "1",
            "--no-progress", "--seed", "5"]  # shuffled by default
    cmd = [sys.executable, "-m", "datapipe", "shard"]
    out = tmp_path / "out"
    done_dir = out / ".datapipe-job" / "done"
    proc = subprocess.Popen(cmd + [args[0], str(out)] + args[1:], cwd=REPO, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if done_dir.exists() and len([n for n in os.listdir(done_dir) if n.endswith(".json")]) >= 3:  # not .tmp-*
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job finished before it could be killed"
    assert not (out / "manifest.json").exists()
    for name in os.listdir(out):  # nothing partial under a final name
        if name.endswith(".tar"):
            _complete_tar(out / name)
    assert subprocess.run(cmd + [args[0], str(out)] + args[1:], cwd=REPO, stderr=subprocess.DEVNULL).returncode == 0
    report = json.load(open(out / "report.json"))
    assert 3 <= report["resumed_partitions"] < report["partitions"]
    ref = tmp_path / "ref"
    assert subprocess.run(cmd + [args[0], str(ref)] + args[1:], cwd=REPO, stderr=subprocess.DEVNULL).returncode == 0
    assert json.load(open(out / "manifest.json")) == json.load(open(ref / "manifest.json"))
    keys = [s["__key__"] for s in read_all(str(out))]
    assert len(keys) == len(set(keys)) == 150
    assert sorted(n for n in os.listdir(out) if n.endswith(".tar")) == \
        sorted(n for n in os.listdir(ref) if n.endswith(".tar"))


# ---- checks, zero-sample jobs, messages (issue: no silent loss) ------------------------------

BROKEN = b"\xff\xd8\xff\xe0 this is not a jpeg"


def test_default_check_skips_a_broken_jpeg_and_strict_names_it(tmp_path, capsys):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=6, classes=("cat", "dog"))
    (root / "dog" / "broken.jpg").write_bytes(BROKEN)
    assert run_cli(root, tmp_path / "out", "--workers", "1") == 0  # default check: PIL opens it, reads its size
    report = json.load(open(tmp_path / "out" / "report.json"))
    assert report["samples"] == 6 and report["num_skipped"] == 1 and report["check_images"] == "open"
    assert report["skipped"][0]["item"].endswith("dog/broken.jpg") and "PIL cannot open" in report["skipped"][0]["error"]
    assert json.load(open(tmp_path / "out" / "manifest.json"))["num_skipped"] == 1
    assert "dog_broken" not in {s["__key__"].replace("/", "_") for s in read_all(str(tmp_path / "out"))}
    capsys.readouterr()
    assert run_cli(root, tmp_path / "strict", "--strict", "--workers", "1") == 1
    err = capsys.readouterr().err
    assert "broken.jpg" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # --check-images none copies it unchecked (documented as unsafe)
    assert run_cli(root, tmp_path / "unchecked", "--check-images", "none", "--workers", "1") == 0
    assert json.load(open(tmp_path / "unchecked" / "report.json"))["samples"] == 7


def test_decode_check_catches_what_the_open_check_lets_through(tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=4, classes=("a",), size=(200, 150))
    good = (root / "a" / "img.000.jpg").read_bytes()
    dht = good.index(b"\xff\xc4")
    (root / "a" / "bad_table.jpg").write_bytes(good[: dht + 5] + b"\xff" * 16 + good[dht + 21:])  # ends whole
    opened = run_shard(str(root), str(tmp_path / "open"), workers=1, progress=False)
    assert opened["samples"] == 5 and opened["num_skipped"] == 0  # the cheap check reads headers and end markers
    decoded = run_shard(str(root), str(tmp_path / "decode"), check_images="decode", workers=1, progress=False)
    assert decoded["samples"] == 4 and decoded["num_skipped"] == 1
    assert decoded["skipped"][0]["item"].endswith("bad_table.jpg") and "decode" in decoded["skipped"][0]["error"]
    with pytest.raises(ValueError, match="check-images"):
        run_shard(str(root), str(tmp_path / "x"), check_images="full", progress=False)


def test_the_default_check_catches_truncated_jpeg_and_png_and_names_empty_files(tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=4, classes=("a",), size=(200, 150))
    good = (root / "a" / "img.000.jpg").read_bytes()
    (root / "a" / "cut.jpg").write_bytes(good[: len(good) // 2])  # header intact, scan data and FFD9 gone
    png = io.BytesIO()
    Image.open(io.BytesIO(good)).save(png, format="PNG")
    (root / "a" / "whole.png").write_bytes(png.getvalue())
    (root / "a" / "cut.png").write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    (root / "a" / "empty.jpg").write_bytes(b"")
    trailing = good + b"\x00" * 64  # bytes after the end marker: still a whole JPEG
    (root / "a" / "trailing.jpg").write_bytes(trailing)
    report = run_shard(root, tmp_path / "out")
    why = {os.path.basename(s["item"]): s["error"] for s in report["skipped"]}
    assert why == {"cut.jpg": "truncated JPEG (no end-of-image marker)",
                   "cut.png": "truncated PNG (no IEND chunk)", "empty.jpg": "empty file"}
    assert report["samples"] == 6


def test_ignored_files_are_counted_and_named(tmp_path, caplog):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=4, classes=("a", "b"))
    for name in ("a/notes.txt", "b/meta.json", "b/x.csv", "readme.md"):
        (root / name).write_text("not an image")
    assert run_cli(root, tmp_path / "out", "--workers", "1") == 0
    report = json.load(open(tmp_path / "out" / "report.json"))
    assert report["samples"] == 4 and report["num_ignored"] == 4
    assert sorted(report["ignored"]) == ["a/notes.txt", "b/meta.json", "b/x.csv", "readme.md"]
    assert json.load(open(tmp_path / "out" / "manifest.json"))["num_ignored"] == 4
    err = caplog.text  # the CLI logs to stderr
    assert "ignored 4 files" in err and "a/notes.txt" in err and "1 more" in err


def test_copy_mode_partitions_are_whole_shards(images, tmp_path):
    """Copying image bytes: one partition per shard, so no tail is merged (rewritten); same bytes for any workers."""
    root, files = images
    one = run_shard(root, str(tmp_path / "one"), max_count=5, workers=1, progress=False)
    two = run_shard(root, str(tmp_path / "two"), max_count=5, workers=2, progress=False)
    assert one["partitions"] == one["shards"] == -(-len(files) // 5)
    assert [s["count"] for s in json.load(open(tmp_path / "one" / "manifest.json"))["shards"]] == [5, 5, 5, 5, 4]
    assert json.load(open(tmp_path / "one" / "manifest.json"))["shards"] == \
        json.load(open(tmp_path / "two" / "manifest.json"))["shards"]
    by_bytes = run_shard(root, str(tmp_path / "bytes"), max_bytes=8 * 1024, workers=1, progress=False)
    assert by_bytes["partitions"] == by_bytes["shards"] > 1


def test_checks_in_a_pool_give_the_same_shards(tmp_path, monkeypatch):
    """Copy jobs check images in a process pool while one process writes: same verdicts and bytes as inline."""
    import datapipe.jobs.shard.local_engine as job

    root = tmp_path / "imgs"
    make_image_folder(str(root), n=30, classes=("a", "b"), size=(64, 48))
    good = (root / "a" / "img.000.jpg").read_bytes()
    (root / "a" / "cut.jpg").write_bytes(good[: len(good) // 2])
    dht = good.index(b"\xff\xc4")
    (root / "a" / "bad_table.jpg").write_bytes(good[: dht + 5] + b"\xff" * 16 + good[dht + 21:])
    (root / "b" / "broken.jpg").write_bytes(BROKEN)
    monkeypatch.setattr(job, "CHECK_POOL_MIN_ITEMS", 1)
    calls = []
    real = job.run_partition
    monkeypatch.setattr(job, "run_partition", lambda *a, **k: calls.append(k.get("check_pool")) or real(*a, **k))
    for check, bad in (("open", {"broken.jpg", "cut.jpg"}), ("decode", {"broken.jpg", "cut.jpg", "bad_table.jpg"})):
        pooled = run_shard(str(root), str(tmp_path / f"pool-{check}"), check_images=check, max_count=7, workers=2,
                       progress=False)
        assert calls and all(c is not None for c in calls)
        calls.clear()
        inline = run_shard(str(root), str(tmp_path / f"inline-{check}"), check_images=check, max_count=7, workers=1,
                       progress=False)
        assert calls and all(c is None for c in calls)
        calls.clear()
        assert {os.path.basename(s["item"]) for s in pooled["skipped"]} == bad
        assert pooled["skipped"] == inline["skipped"] and pooled["samples"] == inline["samples"] == 33 - len(bad)
        assert json.load(open(tmp_path / f"pool-{check}" / "manifest.json"))["shards"] == \
            json.load(open(tmp_path / f"inline-{check}" / "manifest.json"))["shards"]


def test_a_journal_of_the_earlier_seed_rule_is_not_resumed(images, tmp_path):
    """Shuffled orders changed with the one seed rule (#16): an older job's journal must not be mixed in."""
    root, _ = images
    out = tmp_path / "out"
    kw = dict(max_count=5, shuffle=True, seed=4, workers=1, progress=False)
    run_shard(root, str(out), **kw)
    path = out / ".datapipe-job" / "config.json"
    journal = json.load(open(path))
    del journal["config"]["seed_rule"]  # as the earlier rule wrote it
    path.write_text(json.dumps(journal))
    with pytest.raises(ValueError, match="--overwrite"):
        run_shard(root, str(out), **kw)
    assert run_shard(root, str(out), overwrite=True, **kw)["status"] == "ok"
    assert run_shard(root, str(out), **kw)["status"] == "already complete"


@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_truncated_input_tar_counts_the_samples_lost_after_its_cut(tmp_path, capsys, with_manifest):
    """With the input's manifest, every sample is accounted for: written, listed as damaged, or counted as lost."""
    urls, samples = write_shards(tmp_path / "in", [10, 30, 8], manifest=with_manifest)
    data = open(urls[1], "rb").read()
    with open(urls[1], "wb") as f:
        f.write(data[: len(data) // 3 + 100])  # about a third of shard 1 survives, its last sample cut through
    report = run_shard(str(tmp_path / "in"), str(tmp_path / "out"), workers=1, progress=False)
    damaged = [s for s in report["skipped"] if "#" in s["item"]]  # samples cut through, listed by key
    (cut,) = [s for s in report["skipped"] if s["item"] == urls[1]]
    if with_manifest:
        assert report["samples"] + len(damaged) + report["num_lost_samples"] == len(samples) == 48
        assert cut["lost"] == report["num_lost_samples"] > 0
        kept = report["samples"] - 18
        assert f"{kept} of the manifest's 30 samples kept; {cut['lost']} never read" in cut["error"]
        assert kept + cut["lost"] + len(damaged) == 30
    else:  # nothing says how many there were: the cut is listed, no count is made up
        assert report["num_lost_samples"] == 0 and "lost" not in cut and "manifest" not in cut["error"]
    assert run_cli(tmp_path / "in", tmp_path / "out2", "--workers", "1") == 0
    line = capsys.readouterr().out.strip().splitlines()[-2]  # the summary (the last line: what reads it all)
    assert ("samples never read after the cut of a truncated input tar" in line) is with_manifest


# ---- shuffled by default, full shards (issue 44) ----------------------------------------------

def _counts(out):
    return [s["count"] for s in json.load(open(os.path.join(out, "manifest.json")))["shards"]]


def _full_but_one(counts, max_count):
    """Every shard holds max_count samples but at most one."""
    return sum(c != max_count for c in counts) <= 1 and max(counts) == max_count


def test_every_shard_of_a_class_folder_holds_every_class_by_default(tmp_path):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=240, classes=("astronaut", "cat", "coffee"), size=(24, 16))
    run_shard(str(root), str(tmp_path / "out"), max_count=40, workers=2)
    per_shard = {}
    for s in webdataset.WebDataset(str(tmp_path / "out" / "shard-{000000..000005}.tar"), shardshuffle=False):
        per_shard.setdefault(s["__url__"], set()).add(int(s["cls"]))
    assert len(per_shard) == 6 and all(classes == {0, 1, 2} for classes in per_shard.values()), per_shard
    plain = run_shard(str(root), str(tmp_path / "plain"), max_count=40, shuffle=False)
    assert plain["samples"] == 240
    first = next(iter(webdataset.WebDataset(str(tmp_path / "plain" / "shard-000000.tar"), shardshuffle=False
                                             ).batched(40, partial=True)))
    assert set(int(c) for c in first["cls"]) == {0}  # input order: the first shard is one class


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_hold_max_count_but_at_most_one(tmp_path, workers):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=300, classes=("a", "b", "c"), size=(24, 16))
    resized = run_shard(str(root), str(tmp_path / "resized"), max_count=100, resize=8, workers=workers)
    assert resized["samples"] == 300 and _counts(tmp_path / "resized") == [100] * 3
    for i in range(3):  # broken files make partitions of one shard's items write fewer samples
        (root / "a" / f"broken{i}.jpg").write_bytes(BROKEN)
    for name, kw in {"copy": {}, "copy-plain": dict(shuffle=False), "resize": dict(resize=8)}.items():
        report = run_shard(str(root), str(tmp_path / name), max_count=100, workers=workers, **kw)
        assert report["samples"] == 300 and report["num_skipped"] == 3, name
        assert _counts(tmp_path / name) == [100] * 3, (name, _counts(tmp_path / name))
    urls, _ = write_shards(tmp_path / "tars", [10, 3, 0, 8, 5, 12, 7], manifest=False)
    run_shard(str(tmp_path / "tars"), str(tmp_path / "resharded"), max_count=6, workers=workers)
    counts = _counts(tmp_path / "resharded")
    assert sum(counts) == 45 and _full_but_one(counts, 6), counts
    write_jsonl(tmp_path / "docs.jsonl", [f"document {i}" for i in range(40)], bad_line=False)
    run_shard(str(tmp_path / "docs.jsonl"), str(tmp_path / "text"), partition_bytes=300, max_count=8, workers=workers)
    counts = _counts(tmp_path / "text")
    assert sum(counts) == 40 and counts == [8] * 5, counts
