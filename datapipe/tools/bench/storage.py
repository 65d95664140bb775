"""``datapipe bench storage``: how fast shards come off a storage, raw and through ShardStream.

Measurements, each capped at ``seconds``: a raw sequential read (one request after another, the
largest block size: the single-stream ceiling), ShardStream parsing (with and without
``zero_copy`` for local shards), and a sweep over concurrency (threads, optionally processes) x
block sizes, each request a ranged read of ``block_size`` bytes. Every measurement reports MB/s,
files/s and per-request latency percentiles. Local files are read cold where the page cache can be
dropped (``posix_fadvise(POSIX_FADV_DONTNEED)``, verified with ``mincore``) and warm; remote
storage has no local page cache. The recommendation names what to set where (readers in parallel are
the DataLoader's ``num_workers``) and warns when the data set is too small for the figures to hold.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import ctypes.util
import mmap
import os
import sys
import threading
import time
from typing import Any

from datapipe.errors import DataError
from datapipe.storage.files import describe, secrets_of
from datapipe.storage.urls import is_local, local_path, redact_url, url_scheme
from datapipe.units import format_size, percentiles


# ---- arguments ------------------------------------------------------------------------------------
def parse_list(text: str, conv=int) -> list:
    try:
        values = [conv(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"bad list {text!r}: give comma-separated values, e.g. 1,2,4,8 ({e})") from None
    if not values:
        raise ValueError(f"empty list {text!r}")
    return values


# ---- page cache -----------------------------------------------------------------------------------
_libc = None


def _c():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def resident_fraction(path: str) -> float | None:
    """Share of ``path``'s pages in the page cache (0..1; ``mincore``), or None where that cannot be asked."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        lib = _c()
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    try:
        addr = lib.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)


def drop_page_cache(paths: list[str]) -> dict:
    """fsync + ``POSIX_FADV_DONTNEED`` each file, then verify: ``{"dropped", "resident_after", "reason"}``."""
    if not hasattr(os, "posix_fadvise"):
        return {"dropped": False, "resident_after": None, "reason": "posix_fadvise is not available here"}
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    os.fsync(fd)  # dirty pages are not dropped
                except OSError:
                    pass
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as e:
            return {"dropped": False, "resident_after": None, "reason": f"posix_fadvise refused: {e}"}
    fractions = [resident_fraction(p) for p in paths]
    if any(f is None for f in fractions):
        return {"dropped": True, "resident_after": None, "reason": "fadvise accepted; mincore unavailable to verify"}
    sizes = [os.path.getsize(p) for p in paths]
    resident = sum(f * s for f, s in zip(fractions, sizes)) / (sum(sizes) or 1)
    ok = resident < 0.05
    return {"dropped": ok, "resident_after": round(resident, 4),
            "reason": "posix_fadvise(DONTNEED), verified with mincore" if ok else
            f"{resident:.0%} of the bytes stayed cached after fadvise (tmpfs, or a filesystem that ignores it)"}


# ---- reading --------------------------------------------------------------------------------------
class Store:
    """Ranged reads of shards: ``os.pread`` for local files, ``fs.cat_file(start, end)`` (one request) remotely."""

    def __init__(self, urls: list[str], storage_options: dict | None = None):
        self.urls = urls
        self.storage_options = storage_options or {}
        self.local = all(is_local(u) for u in urls)
        self._fs = None
        self._tls = threading.local()

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
        return len(self.fs().cat_file(self.path(url), start=start, end=start + length))

    def close(self) -> None:
        for fd in self._tls.__dict__.pop("fds", {}).values():
            os.close(fd)


def _ranges(sizes: list[int], block: int) -> list[tuple[int, int, int]]:
    return [(i, off, min(block, size - off)) for i, size in enumerate(sizes) for off in range(0, size, block)]


def _read_worker(store: Store, ranges, deadline: float, start_at: float = 0.0, lock=None,
                 repeat: bool = False) -> dict:
    """Read ``ranges`` (a list, or a shared iterator with ``lock``) until done (or, ``repeat``: ``deadline``)."""
    while time.monotonic() < start_at:
        time.sleep(0.001)
    nbytes, lat, done = 0, [], []
    it = itertools.cycle(ranges) if repeat and lock is None else iter(ranges)
    t_first = time.monotonic()
    try:
        while time.monotonic() < deadline:
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
    return {"bytes": nbytes, "latencies": lat, "files": done, "t0": t_first, "t1": time.monotonic()}


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
            list(pool.map(time.sleep, [0.2] * concurrency))  # start the workers before timing
            start_at = time.monotonic() + 0.05
            deadline = start_at + seconds
            futures = [pool.submit(_read_worker, store, ranges[i::concurrency] or ranges[:1], deadline, start_at,
                                   None, repeat) for i in range(concurrency)]
            results = [f.result() for f in futures]
    else:
        raise ValueError(f"mode must be 'threads' or 'processes', got {mode!r}")
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


# ---- the run --------------------------------------------------------------------------------------
def resolve(targets: list[str], storage_options: dict | None = None) -> list[str]:
    """Shard URLs of targets: files, brace specs, directories (with a manifest, or every tar in them)."""
    import fsspec

    from datapipe.tar.manifest import read_manifest
    from datapipe.storage.urls import expand_urls

    urls: list[str] = []
    for target in targets:
        try:
            if target.endswith((".tar", ".tar.gz", ".tgz")) or "{" in target or "::" in target:
                urls += expand_urls(target)
                continue
            manifest = read_manifest(target, storage_options=storage_options, retries=1)
            if manifest is not None:
                urls += [target.rstrip("/") + "/" + s["name"] for s in manifest["shards"]]
                continue
            fs, path = fsspec.core.url_to_fs(target, **(storage_options or {}))
            names = sorted(p for p in fs.ls(path, detail=False) if p.endswith((".tar", ".tar.gz", ".tgz")))
            if not names:
                raise FileNotFoundError(f"no .tar shards in {redact_url(target)}")
            prefix = target.split("://", 1)[0] + "://" if "://" in target else ""
            urls += [prefix + n if prefix and not n.startswith(prefix) else n for n in names]
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"cannot list shards: {type(e).__name__}: {e}", url=redact_url(target)) from e
    if not urls:
        raise DataError("no shards to read")
    return urls


def run_storage(targets: list[str] | str, *, concurrency: list[int] = (1, 2, 4, 8),
                block_sizes: list[int] = (1 << 20, 4 << 20, 16 << 20), seconds: float = 5.0,
                processes: bool = False, storage_options: dict | None = None, progress: bool = True,
                stream: bool = True) -> dict[str, Any]:
    """Measure a storage; returns every figure as a dict (see the module docstring)."""
    from tqdm import tqdm

    targets = [targets] if isinstance(targets, str) else list(targets)
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if not concurrency or min(concurrency) < 1:
        raise ValueError("concurrency values must be >= 1, e.g. 1,2,4,8")
    if not block_sizes or min(block_sizes) < 1:
        raise ValueError("block sizes must be >= 1 byte, e.g. 1M,4M,16M")
    urls = resolve(targets, storage_options)
    store = Store(urls, storage_options)
    sizes = [store.size(u) for u in urls]
    try:  # fail early, with the URL, on storage that lists but does not read
        if sizes[0]:
            store.read(0, 0, min(1024, sizes[0]))
    except Exception as e:
        text, cause = describe(e, secrets_of(urls[0], storage_options))
        raise DataError(f"cannot read shard: {text}", url=redact_url(urls[0])) from cause
    finally:
        store.close()
    local = store.local
    paths = [local_path(u) for u in urls] if local else []
    scheme = "local" if local else url_scheme(urls[0])
    cache: dict[str, Any]
    if local:
        probe = drop_page_cache(paths)
        cache = {"cold_possible": probe["dropped"], **probe}
    else:
        cache = {"cold_possible": False, "reason": "remote: no page cache"}
    modes = ["threads"] + (["processes"] if processes else [])
    seq_states = (["cold", "warm"] if cache["cold_possible"] else ["warm"]) if local else ["remote"]
    stream_variants = ([False, True] if local else [False]) if stream else []
    sweep_state = "cold" if cache["cold_possible"] else ("warm" if local else "remote")
    jobs = len(seq_states) + len(stream_variants) + len(modes) * len(concurrency) * len(block_sizes)
    bar = tqdm(total=jobs, desc="bench storage", unit="run", file=sys.stderr, disable=not progress)

    def cold():
        if sweep_state == "cold":
            drop_page_cache(paths)

    result: dict[str, Any] = {
        "targets": [redact_url(t) for t in targets], "storage": scheme, "shards": len(urls),
        "bytes": int(sum(sizes)), "seconds_cap": seconds, "page_cache": cache,
        "sequential": {}, "stream": {}, "sweep": [],
    }
    seq_block = max(block_sizes)
    if not local:  # connections, sessions and the server's first-request costs are not throughput
        measure_reads(store, sizes[:1], block=seq_block, concurrency=1, seconds=min(seconds, 0.5))
    for state in seq_states:
        bar.set_postfix_str(f"sequential read ({state})")
        if state == "cold":
            drop_page_cache(paths)
        elif state == "warm":
            measure_reads(store, sizes, block=seq_block, concurrency=1, seconds=seconds)  # fill the cache
        r = measure_reads(store, sizes, block=seq_block, concurrency=1, seconds=seconds, repeat=not local)
        result["sequential"][state] = {"block_size": seq_block, **r}
        bar.update(1)
    for zc in stream_variants:
        name = "zero_copy" if zc else "copy"
        bar.set_postfix_str(f"ShardStream ({name}, warm)" if local else "ShardStream")
        result["stream"][name] = {"cache": "warm" if local else "remote",
                                  **measure_stream(urls, seconds=seconds, zero_copy=zc, storage_options=storage_options)}
        bar.update(1)
    for mode in modes:
        for c in concurrency:
            for b in block_sizes:
                bar.set_postfix_str(f"{mode} x{c}, block {format_size(b)} ({sweep_state})")
                cold()
                r = measure_reads(store, sizes, block=b, concurrency=c, seconds=seconds, mode=mode,
                                  repeat=sweep_state != "cold")
                result["sweep"].append({"mode": mode, "concurrency": c, "block_size": b, "cache": sweep_state, **r})
                bar.update(1)
    bar.close()
    result["recommendation"] = recommend(result)
    return result


MIN_BYTES = 256_000_000  # a smaller data set reads in a blink: start-up and noise, not throughput
MIN_SECONDS = 0.5  # a one-pass measurement shorter than this is noise too


def size_warning(result: dict) -> str | None:
    """Why the figures may mean little (too few bytes, or one-pass reads over in a blink), else ``None``."""
    runs = list(result["sequential"].values()) + result["sweep"]
    short = [r for r in runs if r.get("cache") == "cold" or r is result["sequential"].get("cold")]
    fastest = min((r["seconds"] for r in short), default=None)
    if result["bytes"] >= MIN_BYTES and (fastest is None or fastest >= MIN_SECONDS):
        return None
    text = f"the data set is {result['bytes'] / 1e6:.1f} MB"
    if fastest is not None and fastest < MIN_SECONDS:
        text += f" and a cold pass over it took {fastest * 1e3:.0f} ms"
    return (text + f": these figures are mostly start-up and noise; measure at least {MIN_BYTES / 1e6:.0f} MB "
            "(more or bigger shards) for throughput that holds")


def _loader_block() -> int | None:
    try:
        from datapipe.storage.files import REMOTE_BLOCK
    except ImportError:
        return None
    return REMOTE_BLOCK


def recommend(result: dict) -> dict:
    """What to set where, from the sweep: readers in parallel (the loader's workers), and what block size gives.

    ShardStream streams one shard at a time per reader; parallel readers are the DataLoader's
    worker processes (``num_workers``) each holding its own shards. The request size for remote shards
    is the library's (not an option), so a better block size is reported as a fact, not a setting.
    """
    rows = result["sweep"]
    if not rows:
        return {"text": "no sweep measured", "warning": size_warning(result)}
    best = max(rows, key=lambda r: r["mb_per_s"])
    one = max((r for r in rows if r["concurrency"] == 1), key=lambda r: r["mb_per_s"], default=None)
    gain = best["mb_per_s"] / one["mb_per_s"] if one and one["mb_per_s"] > 0 else None
    c, shards = best["concurrency"], result["shards"]
    if c > 1 and gain is not None and gain >= 1.2:
        text = (f"reads scale to {c} in parallel: {best['mb_per_s']:.0f} MB/s, {gain:.1f}x one reader "
                f"({best['cache']}). Read with at least {c} readers: loaders.DataLoader(..., num_workers={c}) or "
                f"torch's DataLoader over a ShardStream (each worker streams its own shards)")
        if shards < c:
            text += f"; with {shards} shards at most {shards} readers are busy: write more, smaller shards"
    else:
        text = (f"one reader already gets {one['mb_per_s'] if one else best['mb_per_s']:.0f} MB/s "
                f"({best['cache']}); more readers in parallel do not read faster here, so choose num_workers for "
                "decoding, not for reading")
    block = _loader_block()
    if block and result.get("storage") != "local":
        at_c = [r for r in rows if r["concurrency"] == c and r["mode"] == best["mode"]]
        ours = next((r for r in at_c if r["block_size"] == block), None)
        top = max(at_c, key=lambda r: r["mb_per_s"])
        if ours and top["block_size"] != block and top["mb_per_s"] >= 1.2 * ours["mb_per_s"]:
            text += (f". ShardStream requests {format_size(block)} per read of a remote shard (fixed); "
                     f"{format_size(top['block_size'])} requests read {top['mb_per_s'] / ours['mb_per_s']:.1f}x "
                     "faster here")
    st = result["stream"].get("zero_copy") or result["stream"].get("copy")
    if st and st["mb_per_s"] > 0:
        text += f". ShardStream parses {st['mb_per_s']:.0f} MB/s in one process"
        if result.get("storage") == "local" and "zero_copy" in result["stream"]:
            text += " with zero_copy=True"
    warning = size_warning(result)
    return {"mode": best["mode"], "concurrency": c, "block_size": best["block_size"], "mb_per_s": best["mb_per_s"],
            "num_workers": c if c > 1 and gain is not None and gain >= 1.2 else None, "text": text,
            "warning": warning}


def rows_for_table(result: dict) -> list[dict]:
    def ms(r, k):
        v = r["latency_ms"][k]
        return "" if v is None else f"{v:.2f}"

    rows = []
    for state, r in result["sequential"].items():
        rows.append({"measurement": "sequential read", "cache": state, "conc": 1, "block": format_size(r["block_size"]),
                     "MB/s": f"{r['mb_per_s']:.1f}", "files/s": f"{r['files_per_s']:.1f}",
                     "p50 ms": ms(r, "p50"), "p90 ms": ms(r, "p90"), "p99 ms": ms(r, "p99")})
    for name, r in result["stream"].items():
        rows.append({"measurement": f"ShardStream ({name})", "cache": r["cache"], "conc": 1, "block": "",
                     "MB/s": f"{r['mb_per_s']:.1f}", "files/s": f"{r['files_per_s']:.1f}",
                     "samples/s": f"{r['samples_per_s']:.0f}",
                     "p50 ms": ms(r, "p50"), "p90 ms": ms(r, "p90"), "p99 ms": ms(r, "p99")})
    for r in result["sweep"]:
        rows.append({"measurement": f"ranged reads ({r['mode']})", "cache": r["cache"], "conc": r["concurrency"],
                     "block": format_size(r["block_size"]), "MB/s": f"{r['mb_per_s']:.1f}",
                     "files/s": f"{r['files_per_s']:.1f}", "p50 ms": ms(r, "p50"), "p90 ms": ms(r, "p90"),
                     "p99 ms": ms(r, "p99")})
    return rows


TABLE_COLUMNS = ["measurement", "cache", "conc", "block", "MB/s", "files/s", "samples/s", "p50 ms", "p90 ms", "p99 ms"]
