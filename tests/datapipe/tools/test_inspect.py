import json

import pytest

from datapipe.cli import main
from datapipe.tools.inspect import inspect_shards
from tests.datapipe.jobs.shard.test_job import run_shard, make_image_folder


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    make_image_folder(str(root), n=12, classes=("a", "b"))
    out = tmp_path_factory.mktemp("shards")
    run_shard(str(root), str(out), max_count=5, workers=1, progress=False)
    return out


def test_summary_of_shard_output(out, capsys):
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 shards, 12 samples" in text and "manifest: yes" in text
    assert "cls (12)" in text and "jpg (12)" in text
    assert "PROBLEM" not in text


def test_json_report(out, capsys):
    assert main(["inspect", str(out), "--json", "--preview", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 12 and [s["samples"] for s in report["shards"]] == [5, 5, 2]
    assert report["extensions"] == {"cls": 12, "jpg": 12} and len(report["preview"]) == 2
    assert report["problems"] == [] and report["manifest"] is True


def test_corrupted_shard_exits_1(out, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    path = bad / "shard-000001.tar"
    data = bytearray(path.read_bytes())
    data[100:108] = b"\xff" * 8  # the first member header's mode field: checksum no longer matches
    path.write_bytes(bytes(data))
    assert main(["inspect", str(bad)]) == 1
    assert "PROBLEM" in capsys.readouterr().out and "shard-000001.tar" in str(inspect_shards(str(bad))["problems"])
    assert main(["inspect", str(bad / "shard-000000.tar")]) == 0


def test_brace_pattern_finds_the_manifest_beside(out, capsys):
    assert main(["inspect", str(out / "shard-{000000..000002}.tar")]) == 0
    assert "manifest: yes" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"just some notes\n", b"x" * 2000, b""])
def test_a_file_that_is_not_a_tar_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "neither a tar file nor a directory" in err and "Not a directory" not in err
    assert len(err.splitlines()) == 1


def test_a_missing_target_and_bad_storage_options(tmp_path, capsys):
    for missing in ("nothing", "nothing/"):  # a folder: worded as ShardStream words it, with what to check
        assert main(["inspect", str(tmp_path / "nothing") + missing[7:]]) == 1
        err = capsys.readouterr().err
        assert "no such folder" in err and "check the path" in err and "does not exist" not in err
    assert main(["inspect", str(tmp_path / "nothing.tar")]) == 1
    assert "nothing.tar does not exist" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path), "--storage-options", "{not json"]) == 2
    assert "--storage-options must be a JSON object" in capsys.readouterr().err


def test_truncated_shard_named_with_its_byte(out, tmp_path, capsys):
    data = (out / "shard-000000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:len(data) // 2 // 512 * 512 + 100])
    assert main(["inspect", str(tmp_path / "cut.tar")]) == 1
    assert "byte" in capsys.readouterr().out


def test_credentials_in_the_url_never_reach_the_output(out, capsys):
    from tests.servers import http_server

    with http_server(str(out)) as (base, _):
        secret = base.replace("http://", "http://alice:hunter2@") + "/shard-000000.tar?token=tok3n&part=1"
        assert main(["inspect", secret, "--preview", "3"]) == 0
        text = capsys.readouterr()
        assert "5 samples" in text.out and "__url__=http://alice:***@127.0.0.1" in text.out
        assert main(["inspect", secret, "--json"]) == 0
        report = capsys.readouterr()
    for shown in (text.out, text.err, report.out, report.err):
        assert "hunter2" not in shown and "tok3n" not in shown
    assert json.loads(report.out)["preview"][0]["__url__"].endswith("/shard-000000.tar?token=***&part=1")


def _closed_port():
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_an_unreachable_host_is_not_reported_as_missing(capsys):
    assert main(["inspect", f"http://127.0.0.1:{_closed_port()}/data/"]) == 1
    err = capsys.readouterr().err
    assert "cannot connect" in err and "does not exist" not in err and "FileNotFoundError" not in err


def test_the_manifest_line_says_what_the_stream_counts_by(tmp_path, capsys, caplog):
    """A pattern naming a shard the folder's manifest does not list: inspect says so, as ShardStream warns."""
    import logging
    import shutil

    from datapipe import ShardStream
    from tests.shards import write_shards

    write_shards(tmp_path / "d", [3, 4])
    extra, _ = write_shards(tmp_path / "e", [2], manifest=False)
    shutil.copy(extra[0], tmp_path / "d" / "shard-000002.tar")
    pattern = str(tmp_path / "d" / "shard-{000000..000002}.tar")
    assert main(["inspect", pattern]) == 0
    assert "3 shards, 9 samples" in capsys.readouterr().out.splitlines()[0]
    assert main(["inspect", pattern, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["manifest"] is False and report["manifest_lists"] == 2
    assert inspect_shards(pattern)["manifest_lists"] == 2
    main(["inspect", pattern])
    assert "manifest: lists 2 of 3 shards" in capsys.readouterr().out
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        assert len(ShardStream(pattern)) == 9
    assert "no manifest lists 1 of 3 shards" in caplog.text


def test_an_http_folder_is_read_as_shardstream_reads_it(out, capsys):
    from tests.servers import http_server

    with http_server(str(out)) as (base, _):
        assert main(["inspect", base + "/"]) == 0
    text = capsys.readouterr().out
    assert "3 shards, 12 samples" in text and "manifest: yes" in text


def test_a_pattern_that_covers_part_of_the_manifest_says_how_much(out, capsys):
    """The README's flow lost a shard in silence: a pattern of 2 of the 3 shards must say so (issue 44)."""
    assert main(["inspect", str(out / "shard-{000000..000001}.tar")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "2 shards, 10 samples" in first and "manifest: 2 of its 3 shards (10 of 12 samples) match this pattern" \
        in first and "manifest: yes" not in first
    report = inspect_shards(str(out / "shard-{000000..000001}.tar"))
    assert report["manifest"] is False and report["manifest_lists"] == 2
    assert (report["manifest_shards"], report["manifest_samples"]) == (3, 12)
    for target in (str(out), str(out / "shard-{000000..000002}.tar")):
        main(["inspect", target])
        assert "manifest: yes, all 3 of its shards (12 samples)" in capsys.readouterr().out
        assert inspect_shards(target)["manifest"] is True


def test_one_shard_of_one_sample_is_counted_in_the_singular(out, tmp_path, capsys):
    import webdataset

    single = tmp_path / "single"
    single.mkdir()
    with webdataset.TarWriter(str(single / "shard-000000.tar")) as w:
        w.write({"__key__": "a", "cls": b"1"})
    assert main(["inspect", str(single / "shard-000000.tar")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert ": 1 shard, 1 sample, " in first and "1 shards" not in first and "1 samples" not in first
    assert main(["inspect", str(out / "shard-000000.tar")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 shard, 5 samples" in first and "manifest: 1 of its 3 shards (5 of 12 samples) matches this pattern" \
        in first


def test_inspect_shows_what_the_shard_job_skipped(tmp_path, capsys):
    """The manifest's num_skipped (inputs the shard job could not read) reaches `datapipe inspect` (#44)."""
    src = tmp_path / "imgs"
    make_image_folder(str(src), n=6, classes=("a", "b"))
    for name in ("broken1.jpg", "broken2.jpg"):
        (src / "a" / name).write_bytes(b"not a jpeg")
    run_shard(str(src), str(tmp_path / "out"), max_count=5, workers=1, progress=False)
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "skipped when sharded: 2 unreadable inputs" in capsys.readouterr().out
    assert inspect_shards(str(tmp_path / "out"))["manifest_skipped"] == 2
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["manifest_skipped"] == 2


def test_inspect_says_when_the_shard_job_checked_no_image(tmp_path, capsys):
    """With --check-images none, "skipped when sharded: 0 unreadable inputs" read as if the images were checked;
    inspect says they were not (the manifest's check_images, #44)."""
    src = tmp_path / "imgs"
    make_image_folder(str(src), n=4, classes=("a", "b"))
    (src / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    run_shard(str(src), str(tmp_path / "none"), check_images="none", workers=1, progress=False)
    assert main(["inspect", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "images not checked when sharded (--check-images none)" in out and "0 unreadable inputs" not in out, out
    assert inspect_shards(str(tmp_path / "none"))["manifest_check_images"] == ["none"]
    run_shard(str(src), str(tmp_path / "open"), workers=1, progress=False)
    assert main(["inspect", str(tmp_path / "open")]) == 0
    out = capsys.readouterr().out
    assert "not checked" not in out and "skipped when sharded: 1 unreadable input " in out, out


def test_a_pattern_longer_than_the_folder_says_how_many_shards_do_not_exist(out, capsys):
    """Issue #44: a pattern two shards past the folder's end said '5 shards' while 2 of them do not exist."""
    target = str(out / "shard-{000000..000004}.tar")
    assert main(["inspect", target]) == 1
    text = capsys.readouterr().out
    first = text.splitlines()[0]
    assert "5 shards named, 2 of them do not exist, 12 samples" in first, first
    assert f"PROBLEM {out / 'shard-000004.tar'}: the shard does not exist" in text
    assert "FileNotFoundError" not in text
    assert inspect_shards(target)["missing"] == 2 and inspect_shards(str(out))["missing"] == 0
    assert main(["inspect", str(out / "shard-{000003..000004}.tar")]) == 1
    assert "2 shards named, none of them exists, 0 samples" in capsys.readouterr().out
