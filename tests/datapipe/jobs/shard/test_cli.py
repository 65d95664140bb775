import argparse
import json
import os

import pytest

from datapipe.jobs.shard.cli import _size
from tests.datapipe.jobs.shard.test_job import run_shard, images, read_all, run_cli  # noqa: F401 (fixture)


def test_sizes():
    assert _size("1000000") == 1_000_000
    assert _size("512M") == 512 << 20 and _size("1G") == _size("1GiB") == _size("1gb") == 1 << 30
    assert _size("1.5k") == 1536
    with pytest.raises(argparse.ArgumentTypeError, match="bad size .lots."):
        _size("lots")


def test_existing_output_and_usage_errors(images, tmp_path, capsys):
    root, files = images
    out = tmp_path / "out"
    assert run_cli(root, out, "--workers", "1") == 0
    assert run_cli(root, out, "--workers", "1", "--max-count", "3") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert run_cli(root, out, "--workers", "1", "--max-count", "3", "--overwrite") == 0
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["num_samples"] == len(files) and all(s["count"] <= 3 for s in manifest["shards"])
    assert len([n for n in os.listdir(out) if n.endswith(".tar")]) == len(manifest["shards"])
    # same arguments again: already complete, nothing rewritten
    assert run_shard(root, str(out), max_count=3, workers=1, progress=False)["status"] == "already complete"
    assert run_cli(root, tmp_path / "x", "--pattern", "shard.tar") == 2
    assert run_cli(root, tmp_path / "x", "--quality", "0") == 2
    assert run_cli(tmp_path / "does-not-exist", tmp_path / "x") == 1
    (tmp_path / "empty").mkdir()
    assert run_cli(tmp_path / "empty", tmp_path / "x") == 1


def test_a_rerun_that_writes_nothing_says_so(images, tmp_path, capsys):
    root, files = images
    out = tmp_path / "out"
    assert run_cli(root, out, "--workers", "1") == 0
    first = capsys.readouterr().out
    assert "samples/s" in first and "wrote" in first
    assert run_cli(root, out, "--workers", "1") == 0
    again = capsys.readouterr().out
    assert "nothing written" in again and "samples/s" not in again and "wrote" not in again
    assert f"it holds {len(files)} samples" in again
    assert "skipped" not in again  # the first run skipped nothing


def test_a_rerun_names_the_option_that_writes_again_and_what_the_first_run_skipped(tmp_path, capsys):
    """The rerun's hint said "change an option or the input", but another --max-count then failed asking for
    --overwrite; it names --overwrite, and the inputs the first run skipped (#44)."""
    from tests.datapipe.jobs.shard.test_job import BROKEN, make_image_folder

    root = tmp_path / "imgs"
    make_image_folder(str(root), n=6, classes=("cat", "dog"))
    for name in ("broken.jpg", "broken2.jpg"):
        (root / "dog" / name).write_bytes(BROKEN)
    out = tmp_path / "out"
    assert run_cli(root, out, "--workers", "1") == 0
    capsys.readouterr()
    assert run_cli(root, out, "--workers", "1") == 0
    again = capsys.readouterr().out
    assert "2 unreadable inputs skipped when it was written, listed in report.json" in again, again
    hint = again[again.index("nothing written"):].splitlines()[0]
    assert "pass --overwrite" in hint and "change an option" not in hint, hint
    # what the hint says holds: another option fails without --overwrite and writes with it
    assert run_cli(root, out, "--workers", "1", "--max-count", "3") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert run_cli(root, out, "--workers", "1", "--max-count", "3", "--overwrite") == 0
    assert "wrote 6 samples" in capsys.readouterr().out


def _zero_sample_inputs(tmp_path):
    (tmp_path / "notatar.tar").write_text("this is a text file, not a tar\n")
    for rel in ("dog/a.txt", "cat/b.json"):
        (tmp_path / "meta" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "meta" / rel).write_text('{"caption": "a dog"}\n')
    for rel in ("dog/1.jpg", "cat/2.jpg"):
        (tmp_path / "fake" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / rel).write_text("plain text named like a JPEG\n")
    return {
        "brace pattern matching no file": (str(tmp_path / "none-{000..009}.tar"), "no file matches"),
        "non-tar file as tar source": (str(tmp_path / "notatar.tar"), "not a tar file"),
        "class folders of .txt/.json only": (str(tmp_path / "meta"), "a.txt"),
        "text files named .jpg": (str(tmp_path / "fake"), "not an image"),
    }


def test_a_job_that_writes_nothing_fails_saying_why(tmp_path, capsys):
    for case, (src, why) in _zero_sample_inputs(tmp_path).items():
        capsys.readouterr()
        out = tmp_path / f"out-{len(case)}"
        assert run_cli(src, out, "--workers", "1") == 1, case
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("datapipe shard: failed:") and why in last, (case, err)
        assert "Traceback" not in err, case
        assert not (out / "manifest.json").exists(), case


def test_cli_messages_for_a_missing_source_and_a_file_as_output(images, tmp_path, capsys):
    root, _ = images
    assert run_cli(tmp_path / "missing", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "missing" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # a job that wrote nothing leaves no folder behind
    (tmp_path / "afile").write_text("x")
    assert run_cli(root, tmp_path / "afile") == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "Errno" not in err and len(err.strip().splitlines()) == 1




def test_an_output_folder_inside_the_source_or_the_source_itself_is_refused(images, tmp_path, capsys):
    """OUT inside SRC would be read as input by the next job (a class folder of an image tree, more tars)."""
    import shutil

    root, _ = images
    src = tmp_path / "photos"
    shutil.copytree(root, src)
    for out, words in ((src / "shards", "is inside SRC"), (src / "dog" / "deeper", "is inside SRC"),
                       (src, "is SRC itself"), (tmp_path / "photos" / ".." / "photos", "is SRC itself")):
        capsys.readouterr()
        assert run_cli(src, out, "--workers", "1") == 2, out
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (src / "shards").exists() and not (src / "dog" / "deeper").exists()  # refused before any write
    assert run_cli(src, tmp_path / "photos-shards", "--workers", "1") == 0  # a sibling named alike is fine


def test_an_input_kind_that_cannot_be_src_and_a_missing_tokenizer_are_usage_errors(images, tmp_path, capsys):
    root, _ = images
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "one.jpg").write_bytes(b"\xff\xd8\xff\xe0")
    cases = ((root, "--input-kind", "list", "is a folder"),
             (tmp_path / "one.jpg", "--input-kind", "images", "put it in a class folder"),
             (tmp_path / "docs.jsonl", "--input-kind", "images", "is a file"),
             (tmp_path / "docs.jsonl", "--tokenizer", str(tmp_path / "nosuch.json"), "no such file"),
             (root, "--tokenizer", "byte", "--tokenizer applies to text input"),
             (root, "--text-field", "body", "is an image folder"))
    for src, flag, value, words in cases:
        capsys.readouterr()
        assert run_cli(src, tmp_path / "out", flag, value, "--workers", "1") == 2, (flag, value)
        err = capsys.readouterr().err
        assert words in err and "Errno" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_file_whose_kind_cannot_be_told_from_its_name_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "one.jpg").write_bytes(b"\xff\xd8\xff\xe0")
    (tmp_path / "data.bin").write_bytes(b"x")
    for src, words in ((tmp_path / "one.jpg", "put it in a class folder"), (tmp_path / "data.bin", "--input-kind")):
        capsys.readouterr()
        assert run_cli(src, tmp_path / "out", "--workers", "1") == 2, src
        err = capsys.readouterr().err
        assert "cannot tell what" in err and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# ---- what the job says it wrote, and its own usage (issue 44) --------------------------------

def test_the_job_ends_by_printing_the_pattern_that_reads_all_it_wrote(images, tmp_path, capsys):
    from datapipe import ShardStream

    root, files = images
    out = tmp_path / "out"
    assert run_cli(root, out, "--workers", "1", "--max-count", "5") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    manifest = json.load(open(out / "manifest.json"))
    n = len(manifest["shards"])
    assert n == 5
    pattern = f"{out}/shard-{{000000..{n - 1:06d}}}.tar"
    assert lines[-1] == f"wrote {len(files)} samples in {n} shards: read them all as {out}/ or {pattern}"
    assert len(ShardStream(pattern)) == len(files) == len(ShardStream(f"{out}/"))
    # a job that finds its output complete says the same (what the folder holds; it wrote nothing)
    assert run_cli(root, out, "--workers", "1", "--max-count", "5") == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == lines[-1].replace("wrote", "it holds", 1)
    # one shard: its name, no braces; other patterns too
    assert run_cli(root, tmp_path / "one", "--workers", "1", "--pattern", "part-%d.tar") == 0
    one = capsys.readouterr().out.strip()
    assert one.endswith(f"as {tmp_path / 'one'}/ or {tmp_path / 'one'}/part-0.tar")
    assert f"samples in 1 shard," in one and f"samples in 1 shard: read" in one and "1 shards" not in one
    assert run_cli(root, tmp_path / "few", "--workers", "1", "--pattern", "p%03d.tar", "--max-count", "10") == 0
    assert capsys.readouterr().out.strip().endswith(f"{tmp_path / 'few'}/p{{000..002}}.tar")


def test_shuffle_is_the_default_and_no_shuffle_keeps_the_input_order(images, tmp_path):
    root, files = images
    orders = {}
    for name, flags in {"default": [], "alias": ["--shuffle"], "plain": ["--no-shuffle"]}.items():
        assert run_cli(root, tmp_path / name, "--workers", "1", *flags) == 0
        orders[name] = [s["__key__"] for s in read_all(str(tmp_path / name))]
    listed = [rel[: -len(".jpg")].replace(".", "_") for rel in sorted(files)]
    assert orders["plain"] == listed
    assert orders["default"] == orders["alias"] != listed and sorted(orders["default"]) == sorted(listed)


def test_a_misspelt_option_prints_the_shard_usage_and_exits_2(tmp_path, capsys):
    from datapipe.cli import main

    with pytest.raises(SystemExit) as info:
        main(["shard", str(tmp_path / "a"), str(tmp_path / "b"), "--max-cout", "5"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: datapipe shard ") and "--max-count" in err
    assert "unrecognized arguments: --max-cout 5" in err and "COMMAND" not in err
    assert not (tmp_path / "b").exists()


def test_help_names_every_input_kind_and_what_each_image_check_catches(capsys):
    from datapipe.cli import main

    with pytest.raises(SystemExit):
        main(["shard", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    head = text[text.index("Convert"):text.index("positional arguments")]
    for kind in ("image folder", "CSV/JSONL list", "JSONL/Parquet text", "tar shards"):
        assert kind in head, kind
    check = text[text.index("--check-images [{open,decode,none}]", text.index("options:")):]
    assert "no pixel is decoded" in check and "damage inside the image data passes" in check
    assert "on_error counts" in check and "'decode' (also decodes every pixel" in check


def test_a_rerun_over_changed_input_or_options_says_what_changed(tmp_path, capsys):
    """Issue #44: after the input changed, the rerun said only 'already holds shards ... pass --overwrite'."""
    from tests.datapipe.jobs.shard.test_job import make_image_folder

    root = tmp_path / "imgs"
    make_image_folder(str(root), n=6, classes=("cat", "dog"))
    out = tmp_path / "out"
    assert run_cli(root, out, "--workers", "1") == 0
    capsys.readouterr()
    extra = tmp_path / "more"
    make_image_folder(str(extra), n=1, classes=("cat",))
    new = next(p for p in (extra / "cat").iterdir())
    new.rename(root / "cat" / ("new" + new.suffix))
    assert run_cli(root, out, "--workers", "1") == 2
    err = capsys.readouterr().err
    assert "its input or options changed since it was written: the input (its files or their sizes)" in err, err
    assert "pass --overwrite" in err
    assert run_cli(root, out, "--workers", "1", "--max-count", "3") == 2
    err = capsys.readouterr().err
    assert "the input (its files or their sizes), --max-count" in err and "-> 3" in err, err
    # shards no job of ours wrote: nothing recorded, so nothing said to have changed
    other = tmp_path / "other"
    other.mkdir()
    (other / "shard-000000.tar").write_bytes(b"")
    assert run_cli(root, other, "--workers", "1") == 2
    err = capsys.readouterr().err
    assert "already holds shards" in err and "changed since" not in err
