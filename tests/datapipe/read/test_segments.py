import tarfile

import pytest

import datapipe.tar.blocks as blocks
from datapipe import DataError, ShardStream
from tests.shards import write_shards


def test_a_sample_is_handed_out_once_the_next_one_is_read(tmp_path, monkeypatch):
    """The reader keeps one whole sample in hand: sample i reaches the consumer after sample i + 1's values
    were read (so the newest value is still alive when the consumer lets older batches go), in order, each once."""
    urls, samples = write_shards(tmp_path, [7])
    read = []
    real = blocks.MmapReader.read
    monkeypatch.setattr(blocks.MmapReader, "read", lambda self, n: read.append(real(self, n)) or read[-1])
    got = []
    for i, sample in enumerate(ShardStream(urls)):
        if i + 1 < len(samples):
            assert samples[i + 1]["bin"] in read  # the next sample is already read
        got.append((sample["__key__"], sample["bin"], sample["cls"]))
    assert got == [(s["__key__"], s["bin"], s["cls"]) for s in samples]


def _damage_header(path, member: int) -> None:
    """Break the checksum of the ``member``-th tar header of ``path``."""
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[member].offset
    with open(path, "r+b") as f:
        f.seek(offset + 1)
        f.write(b"\x7f")


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_samples_before_damage_come_before_its_error(tmp_path, on_error):
    """A damaged header in a shard: every sample read before it is handed out before the error is raised
    (``raise``), and with ``skip`` the samples after it follow in order, the lost ones counted."""
    urls, samples = write_shards(tmp_path, [8])
    _damage_header(urls[0], 10)  # the damage rules lose samples 4 and 5 to it
    keys = [s["__key__"] for s in samples]
    stream = ShardStream(urls, on_error=on_error)
    got = []
    if on_error == "raise":
        with pytest.raises(DataError, match="bad tar header checksum"):
            for sample in stream:
                got.append(sample["__key__"])
        assert got == keys[:4]
    else:
        assert [s["__key__"] for s in stream] == keys[:4] + keys[6:]
        assert stream.stats()["skipped"] == 2
