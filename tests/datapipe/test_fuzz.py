"""Fuzzing the tar reader with damaged shards: no crash, no hang, bounded memory, and every sample
that the damage did not touch is still delivered."""
import gzip
import io
import os
import tarfile
import tempfile
import tracemalloc

import pytest
import webdataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe import DataError, ShardStream
from datapipe.tar.blocks import BlockReader
from datapipe.tar.headers import BLOCK, TarFormatError, _checksum_ok
from datapipe.tar.reader import iter_samples

N = 8
FUZZ = settings(derandomize=True, max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _build():
    """A shard of N two-member samples, and where each sample's bytes lie."""
    buf = io.BytesIO()
    samples = []
    rnd = __import__("random").Random(1)
    with webdataset.TarWriter(buf) as w:
        for i in range(N):
            s = {"__key__": f"k{i:03d}", "bin": rnd.randbytes(rnd.randrange(1, 900)), "cls": str(i).encode()}
            samples.append(s)
            w.write(s)
    data = buf.getvalue()
    spans = {}  # key -> [first header byte, end of last member's padded data)
    headers = []  # (header offset, sample index): member headers and their pax headers
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            key = m.name.split(".")[0]
            i = int(key[1:])
            lo, hi = spans.get(key, (m.offset, 0))
            spans[key] = (min(lo, m.offset), m.offset_data + -(-m.size // BLOCK) * BLOCK)
            for off in range(m.offset, m.offset_data, BLOCK):
                headers.append((off, i))
    return data, samples, [spans[s["__key__"]] for s in samples], headers


DATA, SAMPLES, SPANS, HEADERS = _build()
KEYS = [s["__key__"] for s in SAMPLES]


def _fix_checksum(block: bytearray) -> None:
    assert len(block) == BLOCK
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()


def _read_all(data: bytes, tmp: str, *, gz: bool):
    path = os.path.join(tmp, "shard.tar.gz" if gz else "shard.tar")
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=1) if gz else data)
    skip = ShardStream(path, counts=[N], on_error="skip")
    got = {s["__key__"]: s for s in skip}
    stats = skip.stats()
    assert len(got) + stats["skipped"] == N, "every sample position is delivered or counted as skipped"
    try:
        raised = list(ShardStream(path, counts=[N], on_error="raise"))
    except DataError:
        raised = None
    if raised is not None:  # no error reported: then nothing may be missing
        assert len(raised) == N
    return got


def check_delivery(mutated: bytes, first_bad: int, *, spared=(), gz_spared=None):
    """Samples wholly before ``first_bad`` (bar the one just before, which may have lost a member) and
    the ``spared`` indices must come out unchanged, on the mmap path and the streaming (gzip) path."""
    with tempfile.TemporaryDirectory() as tmp:
        for gz in (False, True):
            got = _read_all(mutated, tmp, gz=gz)
            before = [i for i, (lo, hi) in enumerate(SPANS) if hi <= first_bad][:-1]
            for i in list(before) + list(spared if not gz or gz_spared is None else gz_spared):
                assert got.get(KEYS[i]) is not None, f"untouched sample {KEYS[i]} lost (gzip={gz})"
                assert {k: v for k, v in got[KEYS[i]].items() if k != "__url__"} == SAMPLES[i]
            for key, sample in got.items():
                if key in KEYS:
                    continue
                assert isinstance(key, str)


@FUZZ
@given(st.integers(0, len(DATA) - 1))
def test_truncated_at_any_offset(offset):
    check_delivery(DATA[:offset], offset)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(1, 255)), min_size=1, max_size=6))
def test_flipped_bytes_anywhere(flips):
    data = bytearray(DATA)
    for off, x in flips:
        data[off] ^= x
    check_delivery(bytes(data), min(off for off, _ in flips))


@FUZZ
@given(st.sampled_from(HEADERS), st.lists(st.tuples(st.integers(0, BLOCK - 1), st.integers(1, 255)),
                                          min_size=1, max_size=4))
def test_damaged_header_spares_the_samples_after(header, flips):
    """A header whose checksum fails loses at most its own sample and one neighbour on each side."""
    offset, k = header
    data = bytearray(DATA)
    for off, x in flips:
        data[offset + off] ^= x
    block = bytes(data[offset:offset + BLOCK])
    spared = [i for i in range(N) if abs(i - k) >= 2] if not _checksum_ok(block) else []
    check_delivery(bytes(data), offset + min(off for off, _ in flips), spared=spared)


@FUZZ
@given(st.sampled_from(HEADERS), st.binary(min_size=12, max_size=12))
def test_bogus_size_fields(header, size_field):
    offset, k = header
    data = bytearray(DATA)
    block = bytearray(data[offset:offset + BLOCK])
    block[124:136] = size_field
    _fix_checksum(block)
    data[offset:offset + BLOCK] = block
    check_delivery(bytes(data), offset)


@FUZZ
@given(st.sampled_from(HEADERS), st.sampled_from([10**9, 8 << 30, 1 << 40]), st.booleans())
def test_huge_declared_sizes_are_not_allocated(header, size, base256):
    """A member claiming gigabytes: the mmap path knows the file size and resyncs after the header;
    the streaming path reads what is there. Both in bounded memory."""
    offset, k = header
    data = bytearray(DATA)
    block = bytearray(data[offset:offset + BLOCK])
    octal = f"{size:o}".encode().rjust(12, b"0")
    block[124:136] = (b"\x80" + size.to_bytes(11, "big")) if base256 or len(octal) > 12 else octal
    _fix_checksum(block)
    data[offset:offset + BLOCK] = block
    tracemalloc.start()
    try:
        check_delivery(bytes(data), offset, spared=[i for i in range(N) if abs(i - k) >= 2], gz_spared=[])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, f"peak {peak} bytes for a member that claims {size}"


@FUZZ
@given(st.sampled_from(HEADERS), st.binary(min_size=1, max_size=99).filter(lambda b: b"\0" not in b))
def test_non_utf8_member_names(header, name):
    offset, k = header
    data = bytearray(DATA)
    block = bytearray(data[offset:offset + BLOCK])
    block[0:100] = name.ljust(100, b"\0")
    _fix_checksum(block)
    data[offset:offset + BLOCK] = block
    check_delivery(bytes(data), offset)


def test_huge_size_in_a_stream_reads_only_what_is_there():
    """Without a known file size (a pipe, gzip), a huge size is read in bounded requests until the end."""
    data = bytearray(DATA)
    offset = HEADERS[-1][0]
    block = bytearray(data[offset:offset + BLOCK])
    block[124:136] = b"\x80" + (1 << 60).to_bytes(11, "big")
    _fix_checksum(block)
    data[offset:offset + BLOCK] = block
    tracemalloc.start()
    try:
        with pytest.raises(TarFormatError, match="ends inside"):
            list(iter_samples(BlockReader(io.BufferedReader(io.BytesIO(bytes(data))), seekable=False), "u"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20


def test_shard_with_non_utf8_names_reads_whole(tmp_path):
    path = str(tmp_path / "names.tar")
    names = [b"caf\xe9", b"\xff\xfe", b"ok"]
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        for raw in names:
            for ext, payload in ((".bin", raw * 3), (".cls", b"1")):
                info = tarfile.TarInfo((raw + ext.encode()).decode("utf-8", "surrogateescape"))
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    got = list(ShardStream(path))
    assert [s["__key__"].encode("utf-8", "surrogateescape") for s in got] == names
    assert [s["bin"] for s in got] == [raw * 3 for raw in names]


def test_raise_mode_raises_only_data_error_on_garbage(tmp_path):
    rnd = __import__("random").Random(5)
    path = str(tmp_path / "garbage.tar")
    for _ in range(20):
        with open(path, "wb") as f:
            f.write(DATA[:rnd.randrange(len(DATA))] + rnd.randbytes(rnd.randrange(1, 3000)))
        try:
            list(ShardStream(path, counts=[N]))
        except DataError:
            pass
