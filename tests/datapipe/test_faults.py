"""Remote reads under injected faults, against real servers on 127.0.0.1: an HTTP file server and
moto's S3 server behind a fault-injecting proxy. Every sample exactly once, or a DataError soon."""
import logging
import os
import traceback

import pytest
import torch

from datapipe import DataError, ShardStream
from datapipe.read.options import StorageOptions
from tests.shards import write_shards
from tests.servers import fault_proxy, http_server, s3_server

FAULTS = ["errors_5xx", "resets", "truncations", "hangs", "body_hangs"]
FAST = {"storage": StorageOptions(timeout=1.0, retries=3, backoff=0.02)}


def strip(sample):
    return {k: v for k, v in sample.items() if k != "__url__"}


def full_text(err):
    return "".join(traceback.format_exception(err))


# ---- HTTP ---------------------------------------------------------------------------------------

@pytest.fixture
def web(tmp_path):
    urls, samples = write_shards(tmp_path / "web", [5, 4, 6])
    with http_server(str(tmp_path / "web")) as (base, faults):
        faults.hang_s = 5.0
        yield [f"{base}/{os.path.basename(u)}" for u in urls], samples, faults


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", FAULTS)
def test_http_fault_is_retried_and_every_sample_comes_once(web, fault):
    remote, samples, faults = web
    stream = ShardStream(remote, **FAST)
    stream.counts
    setattr(faults, fault, 2)
    assert [strip(s) for s in stream] == [strip(s) for s in samples]
    assert getattr(faults, fault) == 0, "the fault was injected"
    assert stream.stats()["retries"] >= 1


@pytest.mark.timeout(30)
def test_http_503_on_the_first_request_of_a_shard_is_retried(web):
    """fsspec asks for the size first and reports a 503 there as FileNotFoundError: still transient."""
    remote, samples, faults = web
    stream = ShardStream(remote, **FAST)
    stream.counts
    got = []
    for url in remote:
        faults.errors_5xx = 2  # the next requests: the first ones for this shard
        got += [strip(s) for s in ShardStream([url], **FAST)]
        assert faults.errors_5xx == 0, "the fault was injected"
    assert got == [strip(s) for s in samples]


@pytest.mark.timeout(60)
def test_http_faults_with_dataloader_workers_and_shuffle(web):
    remote, samples, faults = web
    stream = ShardStream(remote, shuffle=True, shuffle_buffer=4, seed=2,
                         storage=StorageOptions(timeout=1.0, retries=8, backoff=0.02))
    stream.counts
    faults.errors_5xx, faults.resets, faults.truncations, faults.body_hangs = 2, 2, 2, 1  # up to 7 in a row
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    keys = [s["__key__"] for s in loader]
    assert sorted(keys) == sorted(s["__key__"] for s in samples)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", ["errors_5xx", "hangs"])  # (resets each send half the rest: a stream resumes on)
def test_http_persistent_fault_is_a_data_error_soon(web, fault):
    remote, samples, faults = web
    stream = ShardStream(remote, storage=StorageOptions(timeout=0.3, retries=2, backoff=0.02))
    stream.counts
    setattr(faults, fault, 10**6)
    with pytest.raises(DataError, match="shard-000000"):
        list(stream)
    skip = ShardStream(remote, storage=StorageOptions(timeout=0.3, retries=1, backoff=0.02), on_error="skip",
                       counts=[5, 4, 6])
    assert list(skip) == [] and skip.stats()["skipped"] == 15


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "skip", "warn"])
def test_http_server_that_stalls_after_16kb_of_every_response_ends_within_the_bound(tmp_path, caplog, on_error):
    """Each response gives 16 KB, then stalls: progress must not restart the retry count forever (#44)."""
    import time

    from datapipe.tar.manifest import make_manifest, write_manifest

    urls, samples = _big_shards(str(tmp_path / "web"), [24], 16000)  # 24 samples, 24 responses' worth
    write_manifest(str(tmp_path / "web"), make_manifest([{"name": "shard-000000.tar", "count": 24,
                                                          "bytes": os.path.getsize(urls[0]), "sha256": ""}]))
    timeout, retries = 0.75, 2
    with http_server(str(tmp_path / "web")) as (base, faults):
        stream = ShardStream(f"{base}/shard-000000.tar", on_error=on_error,
                             storage=StorageOptions(timeout=timeout, retries=retries, backoff=0.02))
        assert stream.counts == [24]
        faults.stall_after, faults.hang_s = 16384, 30.0
        got = []
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="datapipe"):
            if on_error == "raise":
                with pytest.raises(DataError, match="shard-000000.tar") as info:
                    got += [s["__key__"] for s in stream]
                assert "stalled mid-body after 16384 bytes" in str(info.value)
            else:
                got += [s["__key__"] for s in stream]
        elapsed = time.monotonic() - start
    assert elapsed < 3 * (retries + 1) * timeout, f"{elapsed:.1f} s: past the bound"
    assert got == [s["__key__"] for s in samples[:len(got)]], "in order, none twice"
    assert "stalled mid-body after 16384 bytes of the response" in caplog.text and "cannot connect" not in caplog.text
    if on_error != "raise":
        stats = stream.stats()
        assert stats["errors"] == 1 and stats["skipped"] == 24 - len(got) > 0 and stats["retries"] >= retries


@pytest.mark.timeout(30)
def test_http_credentials_never_shown(web, caplog):
    remote, samples, faults = web
    password, token = "pa55-w0rd-XYZ", "t0k3n-QWERTY"
    secret_urls = [u.replace("http://", f"http://alice:{password}@") + f"?token={token}&part=1" for u in remote]
    stream = ShardStream(secret_urls, counts=[5, 4, 6], **FAST)
    with caplog.at_level(logging.DEBUG, logger="datapipe"):
        faults.errors_5xx, faults.resets = 1, 1
        assert [strip(s) for s in stream] == [strip(s) for s in samples]  # credentials do not stop it working
        faults.errors_5xx = 10**6
        with pytest.raises(DataError) as info:
            list(stream)
    text = full_text(info.value) + repr(info.value) + caplog.text + "".join(stream.stats()["last_errors"])
    assert "retrying" in caplog.text and "alice:***@" in text and "token=***" in text
    assert password not in text and token not in text


# ---- S3 (moto) ----------------------------------------------------------------------------------

KEY, SECRET = "AKIAEXAMPLEKEY123456", "s3cr3t/EXAMPLE+key0987654321"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")

    root = tmp_path_factory.mktemp("s3src")
    urls, samples = write_shards(root, [5, 4, 6])
    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                              region_name="us-east-1")
        client.create_bucket(Bucket="bucket")
        for name in os.listdir(root):
            client.upload_file(str(root / name), "bucket", f"data/{name}")
        with fault_proxy(endpoint, is_data=lambda path: ".tar" in path) as (base, faults):
            options = {"key": KEY, "secret": SECRET,
                       "client_kwargs": {"endpoint_url": base, "region_name": "us-east-1"},
                       "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
            yield "s3://bucket/data/shard-{000000..000002}.tar", samples, faults, options


def _reset(faults):
    for name in FAULTS:
        setattr(faults, name, 0)
    faults.hang_s = 5.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", FAULTS)
def test_s3_fault_is_retried_and_every_sample_comes_once(s3, fault):
    spec, samples, faults, options = s3
    _reset(faults)
    stream = ShardStream(spec, storage_options=options, **FAST)
    assert stream.counts == [5, 4, 6]
    before = faults.requests
    setattr(faults, fault, 2)
    assert [strip(s) for s in stream] == [strip(s) for s in samples]
    assert getattr(faults, fault) == 0 and faults.requests > before


@pytest.mark.timeout(60)
def test_s3_persistent_fault_is_a_data_error_and_secrets_stay_hidden(s3, caplog):
    spec, samples, faults, options = s3
    _reset(faults)
    stream = ShardStream(spec, counts=[5, 4, 6],
                         storage_options=options,
                         storage=StorageOptions(timeout=1.0, retries=1, backoff=0.02))
    faults.errors_5xx = 10**6
    try:
        with caplog.at_level(logging.DEBUG, logger="datapipe"), pytest.raises(DataError, match="shard-000000") as info:
            list(stream)
    finally:
        faults.errors_5xx = 0
    text = full_text(info.value) + caplog.text
    assert SECRET not in text and KEY not in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_s3_wrong_credentials_without_counts_is_a_data_error_naming_the_manifest(s3, on_error):
    spec, samples, faults, options = s3
    _reset(faults)
    wrong = {**options, "key": "AKIAWRONGKEY00000000", "secret": "not-the-secret-0000000000000000000000"}
    faults.access_key = KEY  # the proxy checks the key like S3 does (moto accepts any)
    try:
        stream = ShardStream(spec, storage_options=wrong, on_error=on_error,
                             storage=StorageOptions(timeout=2.0, retries=1, backoff=0.02))
        with pytest.raises(DataError, match=r"manifest s3://bucket/data/manifest\.json") as info:
            list(stream)
    finally:
        faults.access_key = None
    assert "not-the-secret" not in full_text(info.value)


@pytest.mark.timeout(60)
def test_connection_failure_on_the_manifest_names_the_manifest():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stream = ShardStream(f"http://127.0.0.1:{port}/d/shard-{{000000..000001}}.tar", 
                         storage=StorageOptions(retries=1, backoff=0.01, timeout=2.0))
    with pytest.raises(DataError) as info:
        stream.counts
    assert f"manifest http://127.0.0.1:{port}/d/manifest.json" in str(info.value)
    assert "shard http" not in str(info.value)


# ---- servers without Range (python -m http.server) ----------------------------------------------

def _big_shards(directory, counts, size):
    import webdataset

    os.makedirs(directory, exist_ok=True)
    rnd, urls, samples = __import__("random").Random(5), [], []
    for shard, n in enumerate(counts):
        urls.append(os.path.join(directory, f"shard-{shard:06d}.tar"))
        with webdataset.TarWriter(urls[-1]) as w:
            for i in range(n):
                samples.append({"__key__": f"s{shard}-{i:03d}", "bin": rnd.randbytes(size), "cls": b"1"})
                w.write(samples[-1])
    return urls, samples


@pytest.mark.timeout(120)
def test_a_server_without_range_streams_every_sample_once(tmp_path):
    from tests.servers import plain_http_server

    urls, samples = _big_shards(str(tmp_path / "web"), [12, 10], 1 << 20)  # past one 8 MB remote block
    with plain_http_server(str(tmp_path / "web"), cuts=2) as (base, requests):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        for on_error in ("raise", "skip"):
            stream = ShardStream(remote, on_error=on_error, counts=[12, 10], **FAST)
            assert [strip(s) for s in stream] == [strip(s) for s in samples]
            assert stream.stats()["errors"] == 0
        got = []
        for rank in range(3):  # ranks start inside shards: the stream reads to there and drops the bytes
            got += [s["__key__"] for s in ShardStream(remote, rank=rank, world_size=3, counts=[12, 10], **FAST)]
        assert set(got) == {s["__key__"] for s in samples}
    assert any(r for _, r in requests), "a resume asked for Range (and got the whole body back)"


def _read_all(f):
    parts = []
    while chunk := f.read(1 << 16):
        parts.append(chunk)
    return b"".join(parts)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", ["ranges", "no-ranges"])
def test_a_streaming_read_skips_and_resumes_with_range_where_the_server_has_it(tmp_path, monkeypatch, server):
    from datapipe.storage.files import RetryingFile
    from tests.servers import plain_http_server

    urls, _ = write_shards(tmp_path / "web", [40])
    whole = open(urls[0], "rb").read()
    monkeypatch.setattr(RetryingFile, "SKIP_BY_READING", 0)  # every skip ahead is a new request
    serving = http_server if server == "ranges" else plain_http_server
    with serving(str(tmp_path / "web")) as (base, log):
        f = RetryingFile(f"{base}/shard-000000.tar", retries=3, backoff=0.01)
        assert f.read(100) == whole[:100]
        if server == "ranges":
            log.truncations = 1  # the next request breaks off: it resumes with Range where it stopped
        f.seek(4096)
        assert _read_all(f) == whole[4096:]
        f.close()
        asked = log.ranges if server == "ranges" else [r for _, r in log]
    assert "bytes=4096-" in asked
    if server == "ranges":
        assert len([r for r in asked if r and r.endswith("-")]) >= 2, asked  # the skip, then the resume
        assert f.ranges is True
    else:
        assert f.ranges is False


@pytest.mark.timeout(120)
def test_bench_storage_on_a_server_without_range(tmp_path):
    from datapipe.tools.bench.storage import run_storage
    from tests.servers import plain_http_server

    _big_shards(str(tmp_path / "web"), [10], 1 << 20)  # past one 8 MB remote block
    with plain_http_server(str(tmp_path / "web")) as (base, _):
        result = run_storage([f"{base}/shard-000000.tar"], concurrency=[1], block_sizes=[1 << 20],
                             seconds=1.0, progress=False)
    assert result["stream"]["copy"]["samples"] == 10


@pytest.mark.timeout(60)
def test_an_s3_folder_is_a_dataset(s3):
    spec, samples, faults, options = s3
    _reset(faults)
    stream = ShardStream("s3://bucket/data", storage_options=options, **FAST)
    assert stream.urls == [f"s3://bucket/data/shard-{i:06d}.tar" for i in range(3)]
    assert [strip(s) for s in stream] == [strip(s) for s in samples]


@pytest.mark.timeout(60)
def test_credentials_never_shown_when_counting_reading_inspecting_and_benching(web, caplog, capsys):
    from datapipe.cli import main

    remote, samples, faults = web
    password, token = "pa55-w0rd-XYZ", "t0k3n-QWERTY"
    base = remote[0].rsplit("/", 1)[0].replace("http://", f"http://alice:{password}@")
    pattern = f"{base}/shard-{{000000..000002}}.tar?token={token}"
    missing = f"{base}/shard-{{000000..000003}}.tar?token={token}"
    texts = []
    with caplog.at_level(logging.DEBUG, logger="datapipe"):  # as `datapipe -v` does (other libraries stay quiet)
        stream = ShardStream(pattern, **FAST)
        assert len(stream) == 15  # counted (no manifest beside a query-token URL): the count cache is looked up
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        for bad in (ShardStream(missing, **FAST), ShardStream(f"{base}/nothing-here.tar?token={token}", **FAST)):
            with pytest.raises(Exception) as info:
                len(bad)
                list(bad)
            texts.append(full_text(info.value) + repr(info.value))
        main(["-v", "bench", "storage", pattern, "--seconds", "0.2", "--concurrency", "1", "--block-size", "1M", "--no-progress"])
        main(["inspect", "-v", missing])
    out = capsys.readouterr()
    own = [r for r in caplog.records if r.name.split(".")[0] in ("datapipe", "loaders")]
    assert any(r.levelno == logging.DEBUG for r in own)
    text = "".join(texts) + out.out + out.err + "".join(f"{r.getMessage()} {r.exc_text or ''}" for r in own)
    assert "alice:***@" in text and "token=***" in text
    assert password not in text and token not in text
