"""A stream's shards counted without a manifest: every failure of the counting pass follows ``on_error`` once."""
import logging
import os
import random

import pytest
import webdataset

from datapipe import DataError, ShardStream
from datapipe.read.options import StorageOptions
from tests.servers import http_server


@pytest.fixture(autouse=True)
def _own_count_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the count cache of remote shards goes under ~/.cache


def _shards(directory):
    """shard-000000.tar: 24 samples of 16 KB (a server that stalls after 16 KB of a response cannot give it);
    shard-000001.tar: 2 small samples (it can). No manifest."""
    os.makedirs(directory)
    rnd, keys = random.Random(3), []
    for shard, (n, size) in enumerate([(24, 16000), (2, 100)]):
        with webdataset.TarWriter(os.path.join(directory, f"shard-{shard:06d}.tar")) as w:
            for i in range(n):
                keys.append(f"s{shard}-{i:03d}")
                w.write({"__key__": keys[-1], "bin": rnd.randbytes(size), "cls": b"1"})
    return keys


STALLING = StorageOptions(timeout=0.5, retries=1, backoff=0.01)


@pytest.mark.timeout(60)
def test_a_read_that_fails_while_counting_is_raised_naming_the_shard(tmp_path):
    _shards(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        faults.stall_after, faults.hang_s = 16384, 30.0
        stream = ShardStream([f"{base}/shard-000000.tar", f"{base}/shard-000001.tar"], storage=STALLING)
        with pytest.raises(DataError, match="counting its samples failed") as info:
            list(stream)
    assert info.value.url.endswith("/shard-000000.tar") and "stalled mid-body" in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_a_read_that_fails_while_counting_is_one_counted_skip(tmp_path, caplog, on_error):
    keys = _shards(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        urls = [f"{base}/shard-000000.tar", f"{base}/shard-000001.tar"]
        faults.stall_after, faults.hang_s = 16384, 30.0
        stream = ShardStream(urls, on_error=on_error, storage=STALLING)
        with caplog.at_level(logging.WARNING, logger="datapipe"):
            got = [s["__key__"] for s in stream]
            assert [s["__key__"] for s in stream] == got, "the next epoch: the same samples, the failure not again"
        assert got == keys[24:], "the shard that could not be counted is skipped whole; the other one is read"
        stats = stream.stats()
        assert stats["errors"] == 1, stats  # once: not again when the read pass (or the next epoch) comes by
        assert 0 < stats["skipped"] < 24, stats  # the complete samples counted before the failure are lost
        assert stats["shards_opened"] == 2, "only the readable shard is opened to read it (once per epoch)"
        assert "counting its samples failed" in stats["last_errors"][0] and "shard-000000.tar" in stats["last_errors"][0]
        assert ("skipped: counting its samples failed" in caplog.text) == (on_error == "warn")
        faults.stall_after = None  # the server recovers: the failure was not cached as a count of 0
        assert [s["__key__"] for s in ShardStream(urls, storage=STALLING)] == keys


def test_one_shard_messages_say_the_shard_not_1_shards(tmp_path, caplog):
    path = tmp_path / "shard-000000.tar"
    with webdataset.TarWriter(str(path)) as w:
        w.write({"__key__": "a", "cls": b"1"})
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        assert len(ShardStream(str(path))) == 1
    assert "no manifest lists the shard: counting" in caplog.text and "1 of 1" not in caplog.text
    with pytest.raises(DataError, match="the shard does not exist") as e:
        len(ShardStream(str(tmp_path / "gone.tar")))
    assert "1 of 1 shards" not in str(e.value)
    with pytest.raises(ValueError, match=r"counts has 1 entry for 2 shards: give one count per URL"):
        ShardStream([str(path), str(path)], counts=[1])


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_brace_range_past_the_last_shard_says_what_the_manifest_lists(tmp_path, caplog, on_error):
    """Issue #44: shard-{000000..000004}.tar over 3 written shards: the two past the end do not exist (said so,
    with the pattern the folder's manifest lists), not "no manifest lists 2 of 5 shards ... run datapipe index"."""
    from tests.shards import write_shards

    write_shards(tmp_path / "out", [4, 4, 4])
    stream = ShardStream(str(tmp_path / "out" / "shard-{000000..000004}.tar"), on_error=on_error)
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        if on_error == "raise":
            with pytest.raises(DataError) as info:
                list(stream)
            text = str(info.value)
        else:
            assert len(list(stream)) == 12
            text = " ".join(stream.stats()["last_errors"])
    assert "2 of 5 shards do not exist" in text and "shard-000003.tar" in text and "shard-000004.tar" in text
    assert f"manifest.json lists 3 shards: {tmp_path / 'out'}/shard-{{000000..000002}}.tar" in text
    assert "no manifest lists" not in caplog.text and "datapipe index" not in caplog.text + text


def _missing_shard_text(stream, on_error, caplog) -> str:
    """The error (``"raise"``) or the counted skips' messages (``"skip"``: the 4 shards' 16 samples read)."""
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        if on_error == "raise":
            with pytest.raises(DataError) as info:
                list(stream)
            assert not isinstance(info.value, FileNotFoundError)
            return str(info.value)
        assert len(list(stream)) == 16
        assert stream.stats()["errors"] == 1, stream.stats()
        return " ".join(stream.stats()["last_errors"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_brace_range_past_the_last_shard_over_http_says_what_the_manifest_lists(tmp_path, caplog, on_error):
    """Issue #44: the remote case as the local one: shard 4 of {000000..000004} does not exist (said so, with what
    the folder's manifest lists), not "no manifest lists 1 of 5 shards ... run datapipe index" and a
    FileNotFoundError."""
    from tests.shards import write_shards

    write_shards(tmp_path / "web" / "shards", [4, 4, 4, 4])
    with http_server(str(tmp_path / "web")) as (base, faults):
        text = _missing_shard_text(ShardStream(f"{base}/shards/shard-{{000000..000004}}.tar", on_error=on_error),
                                   on_error, caplog)
        assert sum("shard-000004.tar" in p for p in faults.paths) <= 2, faults.paths  # HEAD (+ GET): not read
    assert f"1 of 5 shards does not exist: {base}/shards/shard-000004.tar" in text, text
    assert f"manifest.json lists 4 shards: {base}/shards/shard-{{000000..000003}}.tar" in text, text
    assert "FileNotFoundError" not in text and "datapipe index" not in caplog.text + text
    assert "no manifest lists" not in caplog.text


@pytest.mark.timeout(60)
def test_a_remote_shard_counted_once_is_not_asked_for_twice(tmp_path):
    """The look for absent shards keeps each remote shard's stamp for its count: one metadata request, not two."""
    _shards(str(tmp_path / "web"))
    with http_server(str(tmp_path / "web")) as (base, faults):
        assert len(ShardStream([f"{base}/shard-000000.tar", f"{base}/shard-000001.tar"])) == 26
        heads = [p for p in faults.paths if p.startswith("HEAD") and p.endswith("shard-000001.tar")]
    assert len(heads) <= 2, faults.paths  # the stamp, and RetryingFile's own size (a reopen would be a GET)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_brace_range_past_the_last_shard_over_s3(tmp_path, caplog, on_error):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from tests.servers import s3_server
    from tests.shards import write_shards

    write_shards(tmp_path / "src", [4, 4, 4, 4])
    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                              region_name="us-east-1")
        client.create_bucket(Bucket="absent-shards")  # moto's buckets are one per process
        for name in os.listdir(tmp_path / "src"):
            client.upload_file(str(tmp_path / "src" / name), "absent-shards", f"data/{name}")
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        stream = ShardStream("s3://absent-shards/data/shard-{000000..000004}.tar", storage_options=options,
                             on_error=on_error)
        text = _missing_shard_text(stream, on_error, caplog)
    assert "1 of 5 shards does not exist: s3://absent-shards/data/shard-000004.tar" in text, text
    assert "manifest.json lists 4 shards: s3://absent-shards/data/shard-{000000..000003}.tar" in text, text
    assert "no manifest lists" not in caplog.text and "datapipe index" not in caplog.text + text


@pytest.mark.timeout(60)
def test_a_remote_shard_the_manifest_lists_but_storage_lacks_is_said_not_to_exist(tmp_path):
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "web", [4, 4])
    os.remove(urls[1])
    with http_server(str(tmp_path / "web")) as (base, _):
        with pytest.raises(DataError, match="^the shard does not exist") as info:
            list(ShardStream(f"{base}/shard-{{000000..000001}}.tar"))
    assert info.value.url == f"{base}/shard-000001.tar" and "FileNotFoundError" not in str(info.value)


@pytest.mark.parametrize("path", ["nope/", "nope"])
def test_a_folder_that_does_not_exist_is_not_called_a_shard(tmp_path, monkeypatch, path):
    """Issue #44: "no such folder (shard nope/)" called the folder a shard and said nothing to check."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        len(ShardStream(path))
    text = str(info.value)
    assert text.startswith(f"no such folder: {path}: check the path (relative to the current directory, "
                           f"{tmp_path})"), text
    assert "shard-{000000..000009}.tar" in text and "nope/*.tar" in text and "(shard " not in text


def _no_data_error(spec, on_error, caplog) -> DataError:
    """The DataError that ``ShardStream(spec, on_error=on_error)`` raises when first read, with nothing yielded."""
    with caplog.at_level(logging.WARNING, logger="datapipe"), pytest.raises(DataError) as info:
        next(iter(ShardStream(spec, on_error=on_error)))  # an empty folder or glob: raised by the constructor
    return info.value


@pytest.mark.parametrize("on_error", ["raise", "skip", "warn"])
@pytest.mark.parametrize("spec", ["nope/", "nope", "empty/", "nope/*.tar", "nope/shard-{000000..000003}.tar"])
def test_a_spec_that_names_no_shard_is_an_error_in_every_mode(tmp_path, monkeypatch, caplog, on_error, spec):
    """Issue #44: ``ShardStream("nope/", on_error="skip")`` yielded 0 samples (a training loop ran 0 steps) with
    only ``errors=1`` in stats(): a spec with no shard at all is a DataError whatever ``on_error`` says."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("empty")
    text = str(_no_data_error(spec, on_error, caplog))
    if spec.startswith("nope/shard"):
        assert text.startswith("4 of 4 shards do not exist: nope/shard-000000.tar"), text
    elif spec in ("nope/", "nope"):
        assert text.startswith(f"no such folder: {spec}: check the path (relative to the current directory, "), text
    assert "skipped:" not in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["skip", "warn"])
@pytest.mark.parametrize("spec", ["nope/", "nope", "shards/shard-{000000..000001}.tar", "shards/x-000000.tar"])
def test_a_remote_spec_that_names_no_shard_is_an_error_in_every_mode(tmp_path, caplog, on_error, spec):
    (tmp_path / "web" / "shards").mkdir(parents=True)
    with http_server(str(tmp_path / "web")) as (base, _):
        error = _no_data_error(f"{base}/{spec}", on_error, caplog)
    text = str(error)
    if spec.startswith("nope"):
        assert text.startswith(f"no such folder: {base}/{spec}: check the path, or give the shards by a pattern "
                               f"like '{base}/nope/shard-{{000000..000009}}.tar'"), text
        assert "FileNotFoundError" not in text and "cannot list" not in text and error.what == "folder"
    elif "{" in spec:
        assert text.startswith(f"2 of 2 shards do not exist: {base}/shards/shard-000000.tar, "), text
    else:
        assert text.startswith(f"the shard does not exist: {base}/{spec}"), text
    assert "FileNotFoundError" not in text


@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_missing_shards_among_existing_ones_stay_counted_skips(tmp_path, caplog, on_error):
    """The other side of the rule: a stream with some shard that exists reads it and counts the missing ones."""
    from tests.shards import write_shards

    write_shards(tmp_path / "out", [4, 4])
    stream = ShardStream([str(tmp_path / "nope/"), str(tmp_path / "out" / "shard-{000000..000002}.tar")],
                         on_error=on_error)
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        assert len(list(stream)) == 8
    stats = stream.stats()
    assert stats["errors"] == 2, stats
    assert any(e.startswith("no such folder") for e in stats["last_errors"]), stats
    assert any("1 of 4 shards does not exist" in e for e in stats["last_errors"]), stats
    assert ("skipped: " in caplog.text) == (on_error == "warn")
