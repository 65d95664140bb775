"""Timed reads of shards for ``datapipe bench``: ranged raw reads by threads or processes, and ShardStream parsing.

Every measurement reports MB/s, files/s and per-request latency percentiles (:func:`summarize`).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
import time

from datapipe.errors import DataError
from datapipe.storage.files import describe, secrets_of
from datapipe.storage.urls import is_local, local_path, redact_url
from datapipe.units import percentiles

log = logging.getLogger(__name__)


class Store:
    """Ranged reads of shards: ``os.pread`` for local files, ``fs.cat_file(start, end)`` (one request) remotely."""

    def __init__(self, urls: list[str], storage_options: dict | None = None):
        self.urls = urls
        self.storage_options = storage_options or {}
        self.local = all(is_local(u) for u in urls)
        self._fs = None
        self._tls = threading.local()
        self.range_ignored: tuple | None = None  # (url, asked, at, got) of a read the server answered whole
        self._told = False

    def __getstate__(self):
        return {"urls": self.urls, "storage_options": self.storage_options, "local": self.local}

    def __setstate__(self, state):
        self.__init__(state["urls"], state["storage_options"])

    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.urls[0], **self.storage_options)[0]
        return self._fs

    def path(self, url: str) -> str:
        return local_path(url) if self.local else self.fs()._strip_protocol(url)

    def size(self, url: str) -> int:
        try:
            return os.path.getsize(local_path(url)) if self.local else int(self.fs().size(self.path(url)))
        except Exception as e:  # "cannot connect", not fsspec's FileNotFoundError, for an unreachable host
            text, cause = describe(e, secrets_of(url, self.storage_options))
            raise DataError(f"cannot read shard: {text}", url=redact_url(url)) from cause

    def read(self, index: int, start: int, length: int) -> int:
        url = self.urls[index]
        if self.local:
            fds = self._tls.__dict__.setdefault("fds", {})
            fd = fds.get(index)
            if fd is None:
                fd = fds[index] = os.open(local_path(url), os.O_RDONLY)
            return len(os.pread(fd, length, start))
        got = len(self.fs().cat_file(self.path(url), start=start, end=start + length))
        if got > length and self.range_ignored is None:
            self.range_ignored = (url, length, start, got)  # said once, by tell(), not by every reading thread
        return min(got, length)

    def tell(self, results: list[dict] = ()) -> None:
        """Warn, once for this store (whatever its threads and worker processes saw), that the server ignored
        the Range header: the server sends whole files, the rates count what was asked."""
        seen = self.range_ignored or next((r["range_ignored"] for r in results if r.get("range_ignored")), None)
        if seen is None or self._told:
            return
        self._told = True
        url, length, start, got = seen
        log.warning("the server ignored the Range header of %s (asked %d bytes at %d, got %d): each ranged "
                    "read moves more than it asks, so the rates below count only the bytes asked for; a "
                    "server that honours Range measures the reads ShardStream makes", redact_url(url), length,
                    start, got)

    def close(self) -> None:
        for fd in self._tls.__dict__.pop("fds", {}).values():
            os.close(fd)


def _ranges(sizes: list[int], block: int) -> list[tuple[int, int, int]]:
    return [(i, off, min(block, size - off)) for i, size in enumerate(sizes) for off in range(0, size, block)]


def _warm(seconds: float) -> None:
    """(A worker process) this module and its imports loaded, then a pause that keeps the other workers starting."""
    time.sleep(seconds)


def _read_worker(store: Store, ranges, deadline: float, start_at: float = 0.0, lock=None,
                 repeat: bool = False) -> dict:
    """Read ``ranges`` (a list, or a shared iterator with ``lock``) until done (or, ``repeat``: ``deadline``);
    at least one range, so that a worker that started late (a loaded machine) still measures something."""
    while time.monotonic() < start_at:
        time.sleep(0.001)
    nbytes, lat, done = 0, [], []
    it = itertools.cycle(ranges) if repeat and lock is None else iter(ranges)
    t_first = time.monotonic()
    try:
        while not lat or time.monotonic() < deadline:
            if lock is not None:
                with lock:
                    item = next(it, None)
            else:
                item = next(it, None)
            if item is None:
                break
            t0 = time.perf_counter()
            n = store.read(*item)
            lat.append(time.perf_counter() - t0)
            nbytes += n
            done.append(item[0])
    finally:
        store.close()
    return {"bytes": nbytes, "latencies": lat, "files": done, "t0": t_first, "t1": time.monotonic(),
            "range_ignored": store.range_ignored}


def measure_reads(store: Store, sizes: list[int], *, block: int, concurrency: int, seconds: float,
                  mode: str = "threads", repeat: bool = False) -> dict:
    """Ranged reads of ``block`` bytes over all shards by ``concurrency`` threads or processes.

    One pass over the data, stopped at ``seconds``; ``repeat=True`` reads pass after pass until
    ``seconds`` (for storage without a local page cache, where a second pass costs the same).
    """
    ranges = _ranges(sizes, block)
    if mode == "threads":
        lock = threading.Lock()
        shared = itertools.cycle(ranges) if repeat else iter(ranges)
        deadline = time.monotonic() + seconds
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda _: _read_worker(store, shared, deadline, lock=lock), range(concurrency)))
    elif mode == "processes":
        import multiprocessing as mp

        with concurrent.futures.ProcessPoolExecutor(concurrency, mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_warm, [0.2] * concurrency))  # start the workers (and their imports) before timing
            start_at = time.monotonic() + 0.05
            deadline = start_at + seconds
            futures = [pool.submit(_read_worker, store, ranges[i::concurrency] or ranges[:1], deadline, start_at,
                                   None, repeat) for i in range(concurrency)]
            results = [f.result() for f in futures]
    else:
        raise ValueError(f"mode must be 'threads' or 'processes', got {mode!r}")
    store.tell(results)
    total = {i: 0 for i in range(len(sizes))}
    for i, _, _ in ranges:
        total[i] += 1
    got: dict[int, int] = {}
    for r in results:
        for i in r["files"]:
            got[i] = got.get(i, 0) + 1
    files = sum(n // total[i] for i, n in got.items())  # complete passes over each file
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    lat = [x for r in results for x in r["latencies"]]
    return summarize(sum(r["bytes"] for r in results), wall, lat, files)


def summarize(nbytes: int, wall: float, latencies: list[float], files: int) -> dict:
    wall = max(wall, 1e-9)
    return {"mb_per_s": round(nbytes / wall / 1e6, 3), "files_per_s": round(files / wall, 3),
            "bytes": int(nbytes), "seconds": round(wall, 4), "requests": len(latencies), "files": files,
            "latency_ms": percentiles(latencies, scale=1e3, digits=4)}


def measure_stream(urls: list[str], *, seconds: float, zero_copy: bool = False,
                   storage_options: dict | None = None) -> dict:
    """ShardStream over ``urls`` until done or ``seconds``: samples/s, MB/s of values, per-sample latency."""
    from datapipe.read.options import StorageOptions
    from datapipe.stream import ShardStream

    stream = ShardStream(urls, rank=0, world_size=1,
                         storage_options=storage_options,
                         storage=StorageOptions(zero_copy=zero_copy))
    stream.counts  # counting (manifest or walk) is not part of the rate
    n = nbytes = 0
    lat = []
    shards = set()
    t_start = time.perf_counter()
    deadline = t_start + seconds
    it = iter(stream)
    while True:
        t0 = time.perf_counter()
        sample = next(it, None)
        t1 = time.perf_counter()
        if sample is None:
            break
        lat.append(t1 - t0)
        n += 1
        shards.add(sample.get("__url__"))
        nbytes += sum(len(v) for k, v in sample.items() if not k.startswith("__") and hasattr(v, "__len__"))
        if t1 > deadline:
            break
    wall = time.perf_counter() - t_start
    it.close()
    stats = stream.stats()
    done = stats["shards_opened"] - (1 if sample is not None else 0)
    out = summarize(stats["bytes_read"] or nbytes, wall, lat, max(0, done))  # tar bytes: comparable to raw reads
    out["samples"] = n
    out["payload_mb_per_s"] = round(nbytes / max(wall, 1e-9) / 1e6, 3)
    out["samples_per_s"] = round(n / max(wall, 1e-9), 2)
    out["latency_ms_is"] = "per sample"
    return out
