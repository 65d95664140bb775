import os

import pytest

from datapipe import DataError, expand_urls, redact_url


def test_brace_ranges_lists_and_joins():
    assert expand_urls("d/s-{00..02}.tar") == ["d/s-00.tar", "d/s-01.tar", "d/s-02.tar"]
    assert expand_urls("a/{x,y}.tar::s3://b/c-{1..2}.tar") == ["a/x.tar", "a/y.tar", "s3://b/c-1.tar", "s3://b/c-2.tar"]
    assert expand_urls(["file:///x/{a,b}.tar", "https://h/p.tar"]) == ["file:///x/a.tar", "file:///x/b.tar",
                                                                    "https://h/p.tar"]


@pytest.mark.parametrize("spec", ["", "  ", "a::", "x{1..", "x}{", "x{9..1}.tar", "x{a..bb}.tar"])
def test_malformed_specs_are_value_errors(spec):
    with pytest.raises(ValueError):
        expand_urls(spec)


def test_wrong_types():
    with pytest.raises(ValueError):
        expand_urls(3)
    with pytest.raises(ValueError):
        expand_urls(["ok.tar", None])


def test_pipe_refused_unless_allowed():
    with pytest.raises(ValueError, match="allow_pipe"):
        expand_urls("pipe:curl -s http://x/{0..1}.tar")
    assert expand_urls("pipe:cat {a,b}.tar", allow_pipe=True) == ["pipe:cat a.tar", "pipe:cat b.tar"]


def test_redaction_hides_credentials():
    url = "https://alice:s3cret@host/p/s.tar?X-Amz-Signature=abc&X-Amz-Credential=k&part=1"
    red = redact_url(url)
    assert "s3cret" not in red and "abc" not in red and "=k" not in red
    assert "alice" in red and "part=1" in red and "host/p/s.tar" in red
    assert redact_url("/local/path.tar") == "/local/path.tar"


def test_errors_never_show_credentials():
    with pytest.raises(ValueError) as info:
        expand_urls("https://u:topsecret@h/x{1..")
    assert "topsecret" not in str(info.value)


# ---- a folder is a dataset ----------------------------------------------------------------------

def test_a_folder_with_a_manifest_stands_for_its_shards(tmp_path):
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "shards", [2, 3])
    (tmp_path / "shards" / "stray.tar").write_bytes(b"")  # not listed: not part of the dataset
    assert expand_urls(str(tmp_path / "shards")) == urls
    assert expand_urls(str(tmp_path / "shards") + "/") == urls


def test_a_folder_without_a_manifest_stands_for_its_tars_in_name_order(tmp_path):
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "shards", [2, 3, 1], manifest=False)
    (tmp_path / "shards" / "notes.txt").write_text("not a shard")
    os.makedirs(tmp_path / "shards" / "sub.tar.d")
    assert expand_urls(str(tmp_path / "shards")) == sorted(urls)
    assert expand_urls(f"{tmp_path}/shards::{urls[0]}") == sorted(urls) + [urls[0]]


def test_an_fsspec_folder_stands_for_its_tars():
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("b.tar", "a.tar", "x.json"):
        fs.pipe(f"/dsfolder/{name}", b"x")
    assert expand_urls("memory://dsfolder") == ["memory://dsfolder/a.tar", "memory://dsfolder/b.tar"]


def test_an_empty_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no manifest\.json and no \.tar shards.*folder .*empty"):
        expand_urls(str(tmp_path / "empty"))


def test_a_stream_and_the_index_take_a_folder(tmp_path):
    from datapipe import ShardStream
    from tests.shards import write_shards

    _, samples = write_shards(tmp_path / "shards", [2, 3])
    stream = ShardStream(str(tmp_path / "shards"))
    assert [s["__key__"] for s in stream] == [s["__key__"] for s in samples]
    assert stream.counts == [2, 3]
    _, more = write_shards(tmp_path / "plain", [1, 2], manifest=False, prefix="p")
    assert [s["__key__"] for s in ShardStream(tmp_path / "plain")] == [s["__key__"] for s in more]


def test_unpadded_range_over_zero_padded_names_hints_at_padding(tmp_path):
    from tests.shards import write_shards

    write_shards(tmp_path / "shards", [1, 1])
    with pytest.raises(DataError, match=r"zero-padded, write \{000000\.\.000006\}"):
        expand_urls(f"{tmp_path}/shards/shard-{{0..6}}.tar")
    assert len(expand_urls(f"{tmp_path}/shards/shard-{{000000..000001}}.tar")) == 2


def test_an_http_folder_ending_in_a_slash_is_listed(tmp_path):
    from tests.servers import plain_http_server
    from tests.shards import write_shards

    write_shards(tmp_path / "a", [2, 3])
    write_shards(tmp_path / "b", [2, 1], manifest=False)
    with plain_http_server(str(tmp_path)) as (base, _):
        assert expand_urls(f"{base}/a/") == [f"{base}/a/shard-000000.tar", f"{base}/a/shard-000001.tar"]
        assert expand_urls(f"{base}/b/") == [f"{base}/b/shard-000000.tar", f"{base}/b/shard-000001.tar"]
        assert expand_urls(f"{base}/a/shard-000000.tar") == [f"{base}/a/shard-000000.tar"]


@pytest.mark.parametrize("suffix", ["/", ""])
def test_an_http_folder_that_is_not_there_is_no_such_folder_with_or_without_its_slash(tmp_path, suffix):
    """Issue #44: ``http://host/nope/`` said "cannot list the folder: FileNotFoundError: ..." with no advice, while
    ``http://host/nope`` said "no such folder ... check the path": both say the latter."""
    from datapipe import ShardStream
    from tests.servers import plain_http_server

    with plain_http_server(str(tmp_path)) as (base, _):
        with pytest.raises(DataError) as info:
            len(ShardStream(f"{base}/nope{suffix}", on_error="skip"))
    text = str(info.value)
    assert text.startswith(f"no such folder: {base}/nope{suffix}: check the path, or give the shards by a pattern "
                           f"like '{base}/nope/shard-{{000000..000009}}.tar' or a glob like '{base}/nope/*.tar'"), text
    assert "FileNotFoundError" not in text and info.value.what == "folder"


def test_redact_text_hides_credentials_of_every_url_in_any_text():
    from datapipe.storage.urls import redact_text

    text = ("no usable count cache at http://alice:***@h:1/c.json: http://alice:secret@h:1/c.json; "
            "also 's3://b/k?X-Amz-Signature=abc&part=1' and (shard https://h/x-{000..001}.tar?token=tok) end")
    out = redact_text(text)
    assert "secret" not in out and "abc" not in out and "tok)" not in out and "=tok" not in out
    assert "http://alice:***@h:1/c.json; " in out and "X-Amz-Signature=***&part=1'" in out
    assert "https://h/x-{000..001}.tar?token=***) end" in out
    assert redact_text(ValueError("plain http://h/a.tar and /local/path")) == "plain http://h/a.tar and /local/path"
    assert redact_text(out) == out


# ---- globs and folder URLs --------------------------------------------------------------------

def test_a_glob_expands_to_the_files_it_matches_in_name_order(tmp_path, monkeypatch):
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "shards", [2, 3, 1, 2])
    assert expand_urls(f"{tmp_path}/shards/*.tar") == sorted(urls)
    assert expand_urls(f"{tmp_path}/shards/shard-00000?.tar") == sorted(urls)
    assert expand_urls(f"{tmp_path}/shards/shard-00000[13].tar") == [urls[1], urls[3]]
    assert expand_urls(f"file://{tmp_path}/shards/shard-*[02].tar") == [f"file://{urls[0]}", f"file://{urls[2]}"]
    assert expand_urls(f"{tmp_path}/shards/shard-{{000000..000001}}*.tar") == urls[:2]  # braces, then globs
    monkeypatch.chdir(tmp_path)
    assert expand_urls("shards/*.tar") == [f"shards/shard-00000{i}.tar" for i in range(4)]  # relative stays relative


def test_a_stream_reads_a_glob(tmp_path):
    from datapipe import ShardStream
    from tests.shards import write_shards

    _, samples = write_shards(tmp_path / "shards", [2, 3])
    assert [s["__key__"] for s in ShardStream(f"{tmp_path}/shards/*.tar")] == [s["__key__"] for s in samples]


def test_a_glob_that_matches_nothing_is_a_clear_error(tmp_path):
    (tmp_path / "shards").mkdir()
    with pytest.raises(DataError, match=r"glob pattern matches no file.*glob .*shards/\*\.tar"):
        expand_urls(f"{tmp_path}/shards/*.tar")


def test_a_local_file_whose_name_holds_glob_characters_is_read_as_written(tmp_path):
    (tmp_path / "odd[1].tar").write_bytes(b"")
    assert expand_urls(f"{tmp_path}/odd[1].tar") == [f"{tmp_path}/odd[1].tar"]


def test_a_glob_over_an_fsspec_store():
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("b.tar", "a.tar", "c.json"):
        fs.pipe(f"/globbed/{name}", b"x")
    assert expand_urls("memory://globbed/*.tar") == ["memory://globbed/a.tar", "memory://globbed/b.tar"]
    with pytest.raises(DataError, match="matches no file"):
        expand_urls("memory://globbed/*.tgz")


def test_globs_and_folders_over_http(tmp_path):
    from datapipe import ShardStream
    from tests.servers import plain_http_server
    from tests.shards import write_shards

    write_shards(tmp_path / "a", [2, 3, 1])
    _, plain = write_shards(tmp_path / "b", [2, 1], manifest=False)
    with plain_http_server(str(tmp_path)) as (base, _):
        want = [f"{base}/a/shard-00000{i}.tar" for i in range(3)]
        assert expand_urls(f"{base}/a/*.tar") == want
        assert expand_urls(f"{base}/a/shard-00000[02].tar") == [want[0], want[2]]
        for folder in (f"{base}/a", f"{base}/a/"):  # with or without the slash
            assert expand_urls(folder) == want
        for folder in (f"{base}/b", f"{base}/b/"):  # no manifest: the listing's tars
            assert expand_urls(folder) == [f"{base}/b/shard-00000{i}.tar" for i in range(2)]
            assert [s["__key__"] for s in ShardStream(folder)] == [s["__key__"] for s in plain]
        with pytest.raises(DataError, match="matches no file"):
            expand_urls(f"{base}/a/*.tgz")


def test_a_question_mark_in_an_http_url_starts_its_query():
    assert expand_urls("https://h/p/shard-1.tar?sig=abc") == ["https://h/p/shard-1.tar?sig=abc"]


def test_a_glob_and_a_folder_over_s3(tmp_path):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from datapipe import ShardStream
    from tests.servers import s3_server
    from tests.shards import write_shards

    _, samples = write_shards(tmp_path / "src", [2, 3])
    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                              region_name="us-east-1")
        client.create_bucket(Bucket="bucket")
        for name in os.listdir(tmp_path / "src"):
            client.upload_file(str(tmp_path / "src" / name), "bucket", f"data/{name}")
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        want = ["s3://bucket/data/shard-000000.tar", "s3://bucket/data/shard-000001.tar"]
        assert expand_urls("s3://bucket/data/*.tar", storage_options=options) == want
        assert expand_urls("s3://bucket/data", storage_options=options) == want
        stream = ShardStream("s3://bucket/data/shard-*.tar", storage_options=options)
        assert [s["__key__"] for s in stream] == [s["__key__"] for s in samples]


def test_a_long_brace_range_is_made_lazily_for_a_stream():
    from datapipe.storage.urls import shard_urls

    urls = shard_urls("s3://b/shard-{0000000..0999999}.tar")
    assert len(urls) == 1_000_000 and urls[0] == "s3://b/shard-0000000.tar" and urls[-1] == "s3://b/shard-0999999.tar"
    assert urls[5:7] == ["s3://b/shard-0000005.tar", "s3://b/shard-0000006.tar"]
    assert shard_urls("a/{8..11}.tar") == ["a/8.tar", "a/9.tar", "a/10.tar", "a/11.tar"]
    assert expand_urls("a/{08..11}.tar") == ["a/08.tar", "a/09.tar", "a/10.tar", "a/11.tar"]
    assert isinstance(expand_urls("a/{08..11}.tar"), list)
