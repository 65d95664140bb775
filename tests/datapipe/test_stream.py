import io
import logging
import os
import tarfile

import pytest
import torch
import webdataset

from datapipe import DataError, ShardStream
from datapipe.read.options import StorageOptions
from tests.shards import write_shards
from tests.resume import assert_resumes_identically
from tests.servers import http_server


def keys(stream):
    return [s["__key__"] for s in stream]


def strip(sample):
    return {k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")}


def test_same_samples_as_webdataset(shards):
    urls, _ = shards
    ours = [strip(s) for s in ShardStream(urls)]
    theirs = [strip(s) for s in webdataset.WebDataset(urls, shardshuffle=False)]
    assert ours == theirs and len(ours) == 26


def test_webdataset_key_rules_dots_and_multipart_extensions(tmp_path):
    path = str(tmp_path / "x.tar")
    with tarfile.open(path, "w") as tar:
        for name, data in [("a.b/c.d/img01.seg.png", b"1"), ("a.b/c.d/img01.JPG", b"2"), ("__meta__", b"m"),
                           ("a.b/c.d/img02.seg.png", b"3"), ("noext", b"x"), ("dir/", None)]:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    ours = [strip(s) for s in ShardStream(path, counts=[2])]
    theirs = [strip(s) for s in webdataset.WebDataset(path, shardshuffle=False)]
    assert ours == theirs
    assert ours[0] == {"__key__": "a.b/c.d/img01", "seg.png": b"1", "jpg": b"2"}


def test_long_names_pax_and_gnu(tmp_path):
    long_dir = "d" * 150
    for fmt, name in [(tarfile.GNU_FORMAT, "gnu.tar"), (tarfile.PAX_FORMAT, "pax.tar")]:
        p = str(tmp_path / name)
        with tarfile.open(p, "w", format=fmt) as tar:
            for i in range(3):
                data = f"v{i}".encode()
                info = tarfile.TarInfo(f"{long_dir}/sample{i}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        got = [strip(s) for s in ShardStream(p)]
        assert got == [{"__key__": f"{long_dir}/sample{i}", "txt": f"v{i}".encode()} for i in range(3)]


def test_gzip_shards(tmp_path):
    urls, samples = write_shards(tmp_path / "gz", [4, 6], gzip=True)
    assert [strip(s) for s in ShardStream(urls)] == [strip(s) for s in samples]
    stream = ShardStream(urls, rank=1, world_size=2, shuffle=True, shuffle_buffer=3)
    assert len(list(stream)) == 5


def test_counts_without_manifest_are_counted_and_logged(tmp_path, caplog):
    urls, samples = write_shards(tmp_path / "nm", [3, 4], manifest=False)
    with caplog.at_level(logging.WARNING, logger="datapipe.stream"):
        stream = ShardStream(urls)
        assert stream.counts == [3, 4]
    assert "counting their samples once" in caplog.text
    assert len(stream) == 7


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_exactly_once_and_equal_counts(shards, world_size, num_workers):
    urls, samples = shards
    per_rank, seen = [], []
    for rank in range(world_size):
        stream = ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=5, rank=rank, world_size=world_size)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=num_workers)
        got = keys(loader)
        per_rank.append(len(got))
        seen += got
        assert len(got) == len(stream)
    assert len(set(per_rank)) == 1, per_rank
    assert set(seen) == {s["__key__"] for s in samples}
    assert len(seen) - len(samples) == per_rank[0] * world_size - len(samples) < world_size


@pytest.mark.parametrize("num_workers", [0, 3])
def test_fewer_samples_and_shards_than_ranks_times_workers(tmp_path, num_workers):
    urls, samples = write_shards(tmp_path / "few", [2, 1])
    seen, lengths = [], set()
    for rank in range(4):
        loader = torch.utils.data.DataLoader(ShardStream(urls, rank=rank, world_size=4), batch_size=None,
                                             num_workers=num_workers)
        got = keys(loader)
        lengths.add(len(got))
        seen += got
    assert lengths == {1} and set(seen) == {s["__key__"] for s in samples}


def test_equal_batches_per_rank_with_uneven_shards(tmp_path):
    urls, _ = write_shards(tmp_path / "uneven", [50, 1, 7, 23])
    batches = set()
    for rank in range(3):
        stream = ShardStream(urls, rank=rank, world_size=3)
        loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=2,
                                             collate_fn=lambda b: [s["__key__"] for s in b])
        batches.add(sum(1 for _ in loader))
    assert len(batches) == 1


def test_deterministic_and_epoch_dependent(shards):
    urls, _ = shards
    a = ShardStream(urls, shuffle=True, shuffle_buffer=6, seed=1)
    b = ShardStream(urls, shuffle=True, shuffle_buffer=6, seed=1)
    assert keys(a) == keys(b)
    first = keys(a)
    a.set_epoch(1)
    assert keys(a) != first and sorted(keys(a)) == sorted(first)
    assert keys(ShardStream(urls, shuffle=True, shuffle_buffer=6, seed=2)) != first
    assert keys(ShardStream(urls)) == sorted(first)


@pytest.mark.parametrize("shuffle_buffer", [0, 1, 4, 100])
def test_resume_at_every_step(shards, shuffle_buffer):
    urls, _ = shards

    def make():
        s = ShardStream(urls, shuffle=True, shuffle_buffer=shuffle_buffer, seed=7, rank=1, world_size=2)
        s.set_epoch(3)
        return s

    full = assert_resumes_identically(make)
    assert len(full) == 13


def test_resume_refuses_other_world_size(shards):
    urls, _ = shards
    s = ShardStream(urls, rank=0, world_size=2)
    next(iter(s))
    state = s.state_dict()
    other = ShardStream(urls, rank=0, world_size=3)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        next(iter(other))


def test_http_shards_through_a_real_server(tmp_path):
    urls, samples = write_shards(tmp_path / "web", [5, 4, 6])
    with http_server(str(tmp_path / "web")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        got = [strip(s) for s in ShardStream(remote, shuffle=False)]
        assert got == [strip(s) for s in samples]
        assert faults.requests > 0
        spec = base + "/shard-{000000..000002}.tar"
        assert sorted(keys(ShardStream(spec, shuffle=True, shuffle_buffer=5))) == sorted(s["__key__"] for s in samples)


def test_http_transient_faults_are_retried_without_duplicates(tmp_path):
    urls, samples = write_shards(tmp_path / "flaky", [5, 4])
    with http_server(str(tmp_path / "flaky")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        stream = ShardStream(remote, storage=StorageOptions(retries=5))
        assert stream.counts == [5, 4]  # the manifest is read before the faults start
        faults.errors_5xx = 2
        faults.truncations = 1
        faults.resets = 1
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        assert stream.stats()["retries"] >= 1


def test_unreachable_url(tmp_path):
    stream = ShardStream("http://127.0.0.1:9/missing-{0..1}.tar", counts=[2, 2], storage=StorageOptions(retries=1))
    with pytest.raises(DataError, match="127.0.0.1"):
        list(stream)
    skipping = ShardStream("http://127.0.0.1:9/missing-{0..1}.tar", counts=[2, 2], storage=StorageOptions(retries=1),
                           on_error="skip")
    assert list(skipping) == []
    assert skipping.stats()["skipped"] == 4


def test_pipe_refused_unless_allowed(shards):
    urls, _ = shards
    with pytest.raises(ValueError, match="pipe"):
        ShardStream(f"pipe:cat {urls[0]}")
    allowed = ShardStream(f"pipe:cat {urls[0]}", storage=StorageOptions(allow_pipe=True), counts=[10])
    assert len(list(allowed)) == 10


# ---- bad input ---------------------------------------------------------------------------------

def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _member_offsets(path):
    with tarfile.open(path) as tar:
        return [(m.name, m.offset_data - 512) for m in tar.getmembers()]  # the member's own header


def test_bad_header_raise_skip_warn(tmp_path, caplog):
    urls, samples = write_shards(tmp_path / "bad", [6, 4])
    members = _member_offsets(urls[0])
    name, offset = members[4]  # first member of sample 2
    _corrupt(urls[0], offset + 108, b"\xff\xfe garbage")  # uid/gid fields: the checksum fails
    with pytest.raises(DataError) as info:
        list(ShardStream(urls))
    assert "shard-000000.tar" in str(info.value)
    skip = ShardStream(urls, on_error="skip")
    got = keys(skip)
    expected = [s["__key__"] for s in samples]
    bad_key = name.split(".")[0]
    assert got == [k for k in expected if k != bad_key]
    assert skip.stats()["skipped"] == 1
    with caplog.at_level(logging.WARNING, logger="datapipe.stream"):
        warn = ShardStream(urls, on_error="warn")
        assert keys(warn) == got
    assert "skipped" in caplog.text and bad_key in caplog.text


def test_callable_on_error_handler_sees_each_error_once(tmp_path):
    urls, samples = write_shards(tmp_path / "bad", [6, 4])
    name, offset = _member_offsets(urls[0])[4]
    _corrupt(urls[0], offset + 108, b"\xff\xfe garbage")
    seen = []
    handled = ShardStream(urls, on_error=seen.append)  # returns: skip, like "skip"
    skip = ShardStream(urls, on_error="skip")
    assert keys(handled) == keys(skip)
    assert handled.stats()["skipped"] == skip.stats()["skipped"] == 1
    assert len(seen) == handled.stats()["errors"] >= 1 and all(isinstance(e, DataError) for e in seen)
    assert name.split(".")[0] in str(seen[0])

    calls = []

    def stop(err):  # raises: the run stops, and the error is not handed to it a second time
        calls.append(err)
        raise err

    with pytest.raises(DataError, match="bad sample"):
        list(ShardStream(urls, on_error=stop))
    assert len(calls) == 1
    with pytest.raises(TypeError, match="on_error"):
        ShardStream(urls, on_error=3)


def test_illegible_header_drops_its_neighbours_and_counts_them(tmp_path):
    urls, samples = write_shards(tmp_path / "bad", [6])
    name, offset = _member_offsets(urls[0])[5]  # second member of sample 2, name destroyed
    _corrupt(urls[0], offset, b"\xff" * 60)
    skip = ShardStream(urls, on_error="skip")
    got = keys(skip)
    expected = [s["__key__"] for s in samples]
    assert set(got) <= set(expected) and name.split(".")[0] not in got
    assert len(got) + skip.stats()["skipped"] == len(expected)
    assert got[-2:] == expected[-2:]


def test_damaged_pax_header_loses_one_sample(tmp_path):
    urls, samples = write_shards(tmp_path / "pax", [6])
    with tarfile.open(urls[0]) as tar:
        member = tar.getmembers()[4]
    assert member.offset_data - member.offset > 512, "expected webdataset's writer to emit pax headers"
    _corrupt(urls[0], member.offset + 108, b"\xff" * 8)
    skip = ShardStream(urls, on_error="skip")
    got = keys(skip)
    expected = [s["__key__"] for s in samples]
    assert got == [k for k in expected if k != member.name.split(".")[0]]
    assert skip.stats()["skipped"] == 1


def test_truncated_shard(tmp_path):
    urls, samples = write_shards(tmp_path / "trunc", [6, 4])
    size = os.path.getsize(urls[0])
    members = _member_offsets(urls[0])
    with open(urls[0], "r+b") as f:
        f.truncate(members[7][1] + 512 + 3)  # inside the data of sample 3's second member
    with pytest.raises(DataError, match="shard-000000"):
        list(ShardStream(urls))
    skip = ShardStream(urls, on_error="skip")
    got = keys(skip)
    assert got == [s["__key__"] for s in samples[:3] + samples[6:]]
    assert skip.stats()["skipped"] == 3
    assert size > os.path.getsize(urls[0])


def test_shard_disappears_mid_epoch(tmp_path):
    urls, samples = write_shards(tmp_path / "gone", [3, 3])
    stream = ShardStream(urls, on_error="skip")
    it = iter(stream)
    first = [next(it)["__key__"] for _ in range(3)]
    os.remove(urls[1])
    rest = [s["__key__"] for s in it]
    assert first == [s["__key__"] for s in samples[:3]] and rest == []
    assert stream.stats()["skipped"] == 3
    with pytest.raises(DataError, match="shard-000001"):
        list(ShardStream(urls, counts=[3, 3]))


def test_manifest_count_mismatch_is_reported(tmp_path):
    urls, samples = write_shards(tmp_path / "mm", [4])
    with pytest.raises(DataError, match="manifest"):
        list(ShardStream(urls, counts=[3]))
    stream = ShardStream(urls, counts=[5], on_error="skip")
    assert len(list(stream)) == 4 and stream.stats()["skipped"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_error"):
        ShardStream("x.tar", on_error="ignore")
    with pytest.raises(ValueError, match="rank"):
        ShardStream("x.tar", rank=2, world_size=2)
    with pytest.raises(ValueError):
        ShardStream("")


@pytest.mark.parametrize("arg, value", [("shuffle_buffer", "100"), ("seed", 1.5), ("shuffle", "yes"), ("rank", "0"),
                                        ("storage", {"retries": 1}),
                                        ("storage_options", "anon")])
def test_constructor_arguments_are_type_checked(arg, value):
    extra = {"world_size": 1} if arg == "rank" else {}
    with pytest.raises(TypeError, match=f"^{arg} must be"):
        ShardStream("x.tar", **{arg: value}, **extra)


@pytest.mark.parametrize("arg, value", [("retries", None), ("timeout", "60"), ("zero_copy", 1), ("backoff", "0.1"),
                                        ("allow_pipe", "yes"), ("read_threads", True), ("read_threads", 2.0)])
def test_storage_options_are_type_checked(arg, value):
    with pytest.raises(TypeError, match=f"^StorageOptions.{arg} must be"):
        StorageOptions(**{arg: value})


def test_read_threads_out_of_range_are_refused():
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="read_threads must be 0 to 64"):
            StorageOptions(read_threads=bad)


def test_replace_takes_storage_option_names(tmp_path):
    urls, _ = write_shards(str(tmp_path), [3])
    stream = ShardStream(urls, storage=StorageOptions(retries=2)).replace(zero_copy=True, seed=4)
    assert stream.storage == StorageOptions(retries=2, zero_copy=True) and stream.seed == 4
    with pytest.raises(ValueError, match="no option 'retry'"):
        stream.replace(retry=1)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_missing_local_shards_are_named_before_any_counting(tmp_path, caplog, on_error):
    write_shards(tmp_path, [3], manifest=False)
    stream = ShardStream(str(tmp_path / "shard-{000000..000003}.tar"), on_error=on_error)
    with caplog.at_level(logging.WARNING, logger="datapipe"):
        if on_error == "raise":
            with pytest.raises(DataError, match=r"3 of 4 shards do not exist") as info:
                list(stream)
            assert "shard-000001.tar" in str(info.value) and "shard-000003.tar" in str(info.value)
            assert "no manifest lists" not in caplog.text  # the missing files are the news, said first
        else:
            assert len(list(stream)) == 3
            assert stream.stats()["errors"] == 3
            assert "no manifest lists 1 of 4 shards" in caplog.text  # only the one that exists is counted


@pytest.mark.parametrize("suffix", ["/", ""])
def test_a_folder_that_is_not_there_is_named_as_a_folder(tmp_path, suffix):
    with pytest.raises(DataError, match=r"no such folder: .*missing"):
        list(ShardStream(str(tmp_path / "missing") + suffix))


def test_a_fresh_epoch_reads_samples_without_positions(shards, monkeypatch):
    """A fresh epoch with a shuffle buffer reads its samples straight through (no ``(position, sample)`` pair made
    for every sample: positions are read only to rebuild a resumed buffer), in the same order as a resume
    from its start, each sample once."""
    from datapipe.read.segments import SegmentReader

    urls, samples = shards
    make = lambda: ShardStream(urls, shuffle=True, shuffle_buffer=5, seed=3)  # noqa: E731
    resumed = make()
    resumed.load_state_dict(make().state_dict())
    via_positions = keys(resumed)
    used = []
    real = SegmentReader.positions
    monkeypatch.setattr(SegmentReader, "positions", lambda self, *a: used.append(a) or real(self, *a))
    fresh = keys(make())
    assert used == [] and fresh == via_positions and sorted(fresh) == sorted(s["__key__"] for s in samples)


def test_a_resume_on_another_shape_says_once_that_the_order_changes(tmp_path):
    """A state of 2 workers resumed with 0 or 1 gave exactly the rest of the epoch in another order, with no word
    (docs/guarantees.md says the order changes): one INFO line says so, from rank 0's first worker, and none on
    the same shape (#44). A log file catches the line a worker process writes."""
    from tests.datapipe.order.test_elastic import checkpoint, run_rank

    urls, _ = write_shards(tmp_path / "s", [10, 10, 10])
    everything = sorted(s["__key__"] for s in ShardStream(urls))
    logger = logging.getLogger("datapipe.stream")
    level = logger.level
    lines = {}
    for old, new in (((1, 2), (1, 0)), ((1, 2), (1, 1)), ((1, 2), (1, 2)), ((2, 2), (3, 1))):
        before, states = checkpoint(urls, old, 4, shuffle_buffer=4)
        handler = logging.FileHandler(tmp_path / f"log-{old}-{new}.txt")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            after = []
            for rank in range(new[0]):
                stream = ShardStream(urls, shuffle=True, seed=3, rank=rank, world_size=new[0], shuffle_buffer=4)
                after += run_rank(stream, new[1], state=states)[0]
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            handler.close()
        assert set(before + after) == set(everything)
        if old[0] == new[0] == 1:
            assert sorted(before + after) == everything
        lines[new] = (tmp_path / f"log-{old}-{new}.txt").read_text().splitlines()
    for workers in (0, 1):
        assert lines[(1, workers)] == [f"resuming a state of 2 workers with {workers}: the rest of the epoch comes "
                                       "exactly once, in another order"], lines
    assert lines[(1, 2)] == []
    assert len(lines[(3, 1)]) == 1 and lines[(3, 1)][0].startswith("resuming a state of 2 ranks x 2 workers on 3 x 1")


def _marked(stream):
    """One pass: each sample's key with the stream's mark and state_dict() right after it came out."""
    return [(s["__key__"], stream.mark(), stream.state_dict()) for s in stream]


def _rest(make, state):
    resumed = make()
    resumed.load_state_dict(state)
    return keys(resumed)


def _check_marks(make):
    """state_before(mark k) resumes at sample k, state_after(mark k) after it, for every k of the pass."""
    full = keys(make())
    stream = make()
    marked = _marked(stream)
    assert [k for k, _, _ in marked] == full
    for k, (_, mark, state) in enumerate(marked):
        assert stream.state_after(mark) == state  # what state_dict() returned then
        assert _rest(make, stream.state_before(mark)) == full[k:], f"state before sample {k}"
        assert _rest(make, stream.state_after(mark)) == full[k + 1:], f"state after sample {k}"
    return full


@pytest.mark.parametrize("shuffle,shuffle_buffer", [(False, 0), (True, 0), (True, 4)])
@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_state_before_a_sample_resumes_at_it(shards, shuffle, shuffle_buffer, rank, world_size):
    urls, _ = shards

    def make():
        s = ShardStream(urls, shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=3, rank=rank,
                        world_size=world_size)
        s.set_epoch(2)
        return s

    full = _check_marks(make)  # every k: across the shard boundaries, and the epoch's last sample
    shard_of = [k.split("-")[0] for k in full]
    assert any(a != b for a, b in zip(shard_of, shard_of[1:])), "expected a pass over several shards"


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_before_a_sample_resumes_at_it_past_a_lost_sample(tmp_path, world_size):
    urls, _ = write_shards(tmp_path / "lost", [6, 4])
    with tarfile.open(urls[0]) as tar:
        member = tar.getmembers()[4]  # sample 2: lost (its pax header damaged)
    _corrupt(urls[0], member.offset + 108, b"\xff" * 8)
    # alone the lost sample is dropped; across ranks a repeat of the one before takes its place, also in a
    # resume right before it (which reads that one again: tests/datapipe/order/test_padding.py)
    full = _check_marks(lambda: ShardStream(urls, on_error="skip", rank=0, world_size=world_size))
    lost = member.name.split(".")[0]
    assert lost not in full and len(full) == (9 if world_size == 1 else 5)


def test_marks_hold_for_their_pass_only(shards):
    urls, _ = shards
    stream = ShardStream(urls)
    with pytest.raises(ValueError, match="during iteration"):
        stream.mark()
    it = iter(stream)
    next(it)
    mark = stream.mark()
    assert _rest(lambda: ShardStream(urls), stream.state_before(mark)) == keys(ShardStream(urls))
    list(it)
    next(iter(stream))  # another pass
    with pytest.raises(ValueError, match="pass"):
        stream.state_before(mark)


def test_an_iterator_runs_at_the_epoch_and_resume_it_was_made_with(tmp_path):
    """iter() fixes the pass: its epoch, and the resume it takes, whatever happens to the stream before it is read."""
    urls, _ = write_shards(tmp_path / "d", [5, 3, 6])

    def make():
        return ShardStream(urls, shuffle=True, shuffle_buffer=4, seed=2)

    def ref(epoch):
        s = make()
        s.set_epoch(epoch)
        return [x["__key__"] for x in s]

    epoch0, epoch1 = ref(0), ref(1)
    assert epoch0 != epoch1
    stream = make()
    it1 = iter(stream)
    stream.set_epoch(1)
    it2 = iter(stream)
    assert [x["__key__"] for x in it1] == epoch0
    assert [x["__key__"] for x in it2] == epoch1

    # interleaved: each its own pass, and the state after each sample is that of the pass that handed it out
    stream = make()
    it1 = iter(stream)
    stream.set_epoch(1)
    it2 = iter(stream)
    got1, got2 = [next(it1)["__key__"]], [next(it2)["__key__"]]
    got1.append(next(it1)["__key__"])
    state = stream.state_dict()
    got2 += [x["__key__"] for x in it2]
    got1 += [x["__key__"] for x in it1]
    assert (got1, got2) == (epoch0, epoch1)
    resumed = make()
    resumed.load_state_dict(state)
    assert [x["__key__"] for x in resumed] == epoch0[2:]

    # a resume is taken by the iterator made after it is loaded, not by one made later at another epoch
    stream = make()
    stream.load_state_dict(state)
    it1 = iter(stream)
    stream.set_epoch(1)
    it2 = iter(stream)
    assert [x["__key__"] for x in it2] == epoch1
    assert [x["__key__"] for x in it1] == epoch0[2:]
