"""Raw leaves copied out of a segment in threads are the bytes a plain copy gives, each a bytes of its own."""
import random

import numpy as np
import pytest

from loaders.dataloader import copyout


def _segment(sizes, seed=0):
    rnd = random.Random(seed)
    data = bytearray(rnd.randbytes(sum(sizes) + 100))
    spans, offset = [], 7
    for n in sizes:
        spans += [offset, n]
        offset += n
    return memoryview(np.frombuffer(data, np.uint8)), spans


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threaded_copies_equal_plain_ones(monkeypatch, threads):
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    monkeypatch.setattr(copyout, "MIN_LEAF", 64)
    sizes = [0, 1, 63, 64, 65, 5000, 100_000, 3, 250_000, 64] * 3
    view, spans = _segment(sizes)
    got = copyout.copied_out(view, spans, threads=threads)
    want = [bytes(view[o:o + n]) for o, n in zip(spans[::2], spans[1::2])]
    assert got == want and all(type(b) is bytes for b in got)
    assert [hash(b) for b in got] == [hash(b) for b in want]
    assert len({id(b) for b in got if len(b) >= 64}) == len([b for b in got if len(b) >= 64])
    view[7] = view[7] ^ 0xFF  # the copies do not alias the segment
    assert got[0:2] == want[0:2] and got[3] == want[3]


def test_the_copies_go_on_while_the_caller_works_and_a_failed_one_raises_at_the_wait(monkeypatch):
    import threading

    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    view, spans = _segment([100_000] * 6)
    release, callers = threading.Event(), set()
    original = copyout._copy

    def held(jobs):  # each copy waits until the caller has come back with the leaves
        callers.add(threading.get_ident())
        release.wait(10)
        original(jobs)

    monkeypatch.setattr(copyout, "_copy", held)
    out, copying = copyout.copying_out(view, spans, threads=3)
    assert len(out) == 6 and copying.pending  # back before any copy is done
    release.set()
    copying.wait()
    assert out == [bytes(view[o:o + n]) for o, n in zip(spans[::2], spans[1::2])]
    assert threading.get_ident() not in callers  # the pool copied it all

    def broken(jobs):
        raise MemoryError("copy failed")

    monkeypatch.setattr(copyout, "_copy", broken)
    with pytest.raises(MemoryError, match="copy failed"):
        copyout.copied_out(view, spans, threads=2)


def test_small_batches_and_small_machines_copy_plainly(monkeypatch):
    made = []
    monkeypatch.setattr(copyout, "_new_bytes", lambda *a: made.append(a) or bytes(a[1]))
    view, spans = _segment([100_000] * 8)
    assert copyout.copied_out(view, spans, threads=1) == [bytes(view[o:o + n]) for o, n in
                                                          zip(spans[::2], spans[1::2])]
    assert copyout.copied_out(view, spans[:2], threads=4)  # 100 KB: under MIN_BATCH_BYTES
    assert not made


def test_a_span_outside_the_segment_is_refused(monkeypatch):
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    view, spans = _segment([1000, 1000])
    with pytest.raises(ValueError, match="outside"):
        copyout.copied_out(view, spans[:2] + [len(view) - 10, 100], threads=2)


def _written_shards(tmp_path, *, seed: int) -> list[dict]:
    """300 samples of 0.5-40 KB written as 3 shards into ``tmp_path``; returns them."""
    from datapipe import ShardWriter

    rnd = random.Random(seed)
    samples = [{"__key__": f"k{i:04d}", "bin": rnd.randbytes(rnd.randrange(500, 40_000)), "cls": str(i)}
               for i in range(300)]
    with ShardWriter(str(tmp_path / "s-%03d.tar"), max_count=100) as w:
        for s in samples:
            w.write(s)
    return samples


def test_worker_batches_copied_in_threads_come_out_exact(monkeypatch, tmp_path):
    from datapipe import ShardStream
    from loaders import DataLoader

    monkeypatch.setattr(copyout, "copy_threads", lambda: 3)
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 1 << 16)
    monkeypatch.setattr(copyout, "MIN_LEAF", 1024)
    samples = _written_shards(tmp_path, seed=1)
    calls = []
    real = copyout._copy
    monkeypatch.setattr(copyout, "_copy", lambda jobs: calls.append(len(jobs)) or real(jobs))
    loader = DataLoader(ShardStream(str(tmp_path)), batch_size=32, num_workers=2, collate_fn=lambda b: b)
    got = {s["__key__"]: (s["bin"], s["cls"]) for batch in loader for s in batch}
    assert got == {s["__key__"]: (s["bin"], s["cls"].encode()) for s in samples}
    assert sum(calls) > 0  # the threaded copy ran


def test_a_failed_submit_waits_for_the_copies_under_way(monkeypatch):
    """If handing a share to the pool fails, the shares already running finish before the error comes out: no
    thread writes into a leaf after the leaves are gone."""
    import threading

    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    view, spans = _segment([200_000] * 6)
    started, release = threading.Event(), threading.Event()
    real_copy = copyout._copy

    def slow_copy(jobs):
        started.set()
        release.wait(5)
        real_copy(jobs)

    class Pool:
        def __init__(self):
            self.real = copyout.ThreadPoolExecutor(1)
            self.n = 0

        def submit(self, fn, arg):
            self.n += 1
            if self.n == 2:
                started.wait(5)
                threading.Timer(0.2, release.set).start()
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            return self.real.submit(slow_copy, arg)

    pool = Pool()
    monkeypatch.setattr(copyout, "_executor", lambda workers: pool)
    with pytest.raises(RuntimeError, match="cannot schedule"):
        copyout.copied_out(view, spans, threads=3)
    assert release.is_set()  # the running share was waited for before the error came out
    pool.real.shutdown(wait=True)


def test_an_interrupt_while_waiting_is_raised_only_once_every_copy_has_ended(monkeypatch):
    import threading
    import time

    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    view, spans = _segment([100_000] * 4)
    ended = []
    original = copyout._copy

    def slow(jobs):
        time.sleep(0.2)
        original(jobs)
        ended.append(threading.get_ident())

    calls = []
    real_wait = copyout.wait

    def interrupted_once(futures):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the wait
        return real_wait(futures)

    monkeypatch.setattr(copyout, "_copy", slow)
    monkeypatch.setattr(copyout, "wait", interrupted_once)
    out, copying = copyout.copying_out(view, spans, threads=2)
    with pytest.raises(KeyboardInterrupt):
        copying.wait()
    assert len(ended) == 2 and copying.keep is None  # raised after both copies ended
    assert out == [bytes(view[o:o + n]) for o, n in zip(spans[::2], spans[1::2])]


def _file_segment(tmp_path, sizes, head=64, seed=2):
    """A segment's data ``view`` over a file that holds ``head`` bytes before it, and the file's descriptor."""
    import mmap
    import os

    view, spans = _segment(sizes, seed)
    path = tmp_path / "segment"
    path.write_bytes(bytes(head) + bytes(view))
    fd = os.open(path, os.O_RDWR)
    mapped = mmap.mmap(fd, 0)
    return fd, memoryview(mapped)[head:], spans


@pytest.mark.parametrize("reads", [2, 3, 8])
def test_leaves_read_from_the_segments_file_equal_plain_copies(monkeypatch, tmp_path, reads):
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    fd, view, spans = _file_segment(tmp_path, [0, 1, 63, 64, 5000, 100_000, 3, 1 << 20, 64] * 3)
    started = []
    real = copyout.start_spans
    monkeypatch.setattr(copyout, "start_spans", lambda *a, **k: started.append(k["threads"]) or real(*a, **k))
    out, copying = copyout.copying_out(view, spans, threads=1, fd=fd, fd_offset=64, reads=reads)
    assert type(copying) is copyout._ReadOut and started == [reads]
    copying.wait()
    want = [bytes(view[o:o + n]) for o, n in zip(spans[::2], spans[1::2])]
    assert out == want and all(type(b) is bytes for b in out)
    assert [hash(b) for b in out] == [hash(b) for b in want]
    assert copying.keep is None


def test_a_short_read_is_copied_from_the_mapping_instead(monkeypatch, tmp_path):
    """The file holds less than the mapping claims (here: another, shorter file): the leaves still come out
    exact, copied from the mapping once the reads are done."""
    import os

    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    _, view, spans = _file_segment(tmp_path, [200_000] * 6)
    other = tmp_path / "short"
    other.write_bytes(b"x" * 300_000)
    fd = os.open(other, os.O_RDONLY)
    out, copying = copyout.copying_out(view, spans, threads=1, fd=fd, fd_offset=64, reads=2)
    copying.wait()
    assert out == [bytes(view[o:o + n]) for o, n in zip(spans[::2], spans[1::2])]


def test_no_reads_where_none_are_asked_or_they_cannot_start(monkeypatch, tmp_path):
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    fd, view, spans = _file_segment(tmp_path, [100_000] * 4)
    want = [bytes(view[o:o + n]) for o, n in zip(spans[::2], spans[1::2])]
    started = []
    monkeypatch.setattr(copyout, "start_spans", lambda *a, **k: started.append(1))  # as where preadv is missing
    for reads in (0, 1, 2):
        out, copying = copyout.copying_out(view, spans, threads=1, fd=fd, fd_offset=64, reads=reads)
        copying.wait()
        assert out == want and type(copying) is copyout.Copying
    assert started == [1]  # only reads=2 tried, and fell back to a plain copy
    out, copying = copyout.copying_out(view, spans, threads=2, fd=None, reads=4)  # no file: the memmove threads
    copying.wait()
    assert out == want and started == [1]


def test_segment_fd_is_torchs_kept_descriptor_only():
    import torch

    shared = torch.UntypedStorage._new_shared(4096)
    torch.empty(0, dtype=torch.uint8).set_(shared, 0, (8,), (1,)).copy_(torch.arange(1, 9, dtype=torch.uint8))
    assert copyout.segment_fd(shared, bytes(range(1, 9))) is not None
    assert copyout.segment_fd(shared, b"another") is None  # the file does not start with the storage's bytes
    assert copyout.segment_fd(torch.UntypedStorage(4096), bytes(8)) is None  # private memory: no file
    assert copyout.segment_fd(object(), b"") is None


def test_read_threads_need_a_large_machine(monkeypatch):
    from datapipe.device import autotune

    for cores, want in ((2, 0), (8, 0), (12, 6), (16, 8), (64, 8)):
        monkeypatch.setattr(autotune, "usable_cores", lambda c=cores: c)
        assert copyout.read_threads() == want


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_batches_read_from_their_segments_files_come_out_exact(monkeypatch, tmp_path, workers):
    from datapipe import ShardStream
    from loaders import DataLoader

    from loaders.dataloader import vmread

    monkeypatch.setattr(vmread, "ENABLED", False)  # every batch through its segment
    monkeypatch.setattr(copyout, "read_threads", lambda: 3)
    monkeypatch.setattr(copyout, "copy_threads", lambda: 1)
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 1 << 16)
    samples = _written_shards(tmp_path, seed=3)
    reads = []
    real = copyout.start_spans
    monkeypatch.setattr(copyout, "start_spans", lambda *a, **k: reads.append(1) or real(*a, **k))
    loader = DataLoader(ShardStream(str(tmp_path)), batch_size=32, num_workers=workers, collate_fn=lambda b: b)
    for _ in range(2):
        got = {s["__key__"]: (s["bin"], s["cls"]) for batch in loader for s in batch}
        assert got == {s["__key__"]: (s["bin"], s["cls"].encode()) for s in samples}
    assert len(reads) > 4  # the batches were read from their segments' files
