"""keep_freed_memory: glibc malloc's thresholds raised once per process, unless the user chose them; the stream
calls it when reading starts unless StorageOptions says not to."""
import os
import platform
import subprocess
import sys

import pytest

from datapipe import ShardStream
from datapipe.read import heap
from datapipe.read.options import StorageOptions
from tests.shards import write_shards

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_user_settings_are_left_alone():
    assert heap.user_set_thresholds({"MALLOC_TRIM_THRESHOLD_": "1000"})
    assert heap.user_set_thresholds({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"})
    assert not heap.user_set_thresholds({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"})
    assert not heap.user_set_thresholds({})


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_raises_the_thresholds_once(monkeypatch):
    calls = []

    class Mallopt:  # stands for libc's function (argtypes and restype are set on it)
        def __call__(self, param, value):
            calls.append((param, value))
            return 1

    libc = type("Libc", (), {})()
    libc.mallopt = Mallopt()
    monkeypatch.setattr(heap, "_done", False)
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: libc)
    for name in heap.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert heap.keep_freed_memory() and heap.keep_freed_memory()
    assert calls == [(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD), (heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD)]


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_not_where_the_user_set_a_threshold(monkeypatch):
    monkeypatch.setattr(heap, "_done", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.keep_freed_memory() is False
    assert heap._done is False


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_freed_memory_is_reused_in_a_real_process():
    """In a fresh process: after the call, a batch of 100 KB values freed and allocated again faults no pages."""
    code = """
import os, resource, sys
from datapipe.read.heap import keep_freed_memory
def faults():
    held = None
    for _ in range(5):
        held = [os.urandom(100_000) for _ in range(64)]
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        held = [bytes(100_000) for _ in range(64)]
        held = None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
before = faults()
assert keep_freed_memory()
faults()
print(before, faults())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
    before, after = map(int, out.stdout.split())
    assert before > 1000 and after < before / 10, (before, after)


@pytest.mark.parametrize("keep", [True, False])
def test_the_stream_calls_it_unless_told_not_to(tmp_path, monkeypatch, keep):
    urls, _ = write_shards(tmp_path, [3])
    called = []
    monkeypatch.setattr("datapipe.stream.keep_freed_memory", lambda: called.append(1) or True)
    stream = ShardStream(urls, storage=StorageOptions(keep_freed_memory=keep))
    assert len(list(stream)) == 3
    assert bool(called) is keep


def test_option_is_checked():
    with pytest.raises(TypeError, match="keep_freed_memory must be bool"):
        StorageOptions(keep_freed_memory=1)
