"""``datapipe bench storage``: how fast shards come off a storage, raw and through ShardStream.

Measurements, each capped at ``seconds``: a raw sequential read (one request after another, the
largest block size: the single-stream ceiling), ShardStream parsing (with and without
``zero_copy`` for local shards), and a sweep over concurrency (threads, optionally processes) x
block sizes, each request a ranged read of ``block_size`` bytes. Every measurement reports MB/s,
files/s and per-request latency percentiles. Local files are read cold where the page cache can be
dropped (``posix_fadvise(POSIX_FADV_DONTNEED)``, verified with ``mincore``) and warm; remote
storage has no local page cache. The recommendation names what to set where (readers in parallel are
the DataLoader's ``num_workers``) and warns when the data set is too small for the figures to hold.

The parts: this module resolves the targets and runs the measurements;
:mod:`datapipe.tools.bench.storage_reads` times the reads, :mod:`datapipe.tools.bench.page_cache` drops the
page cache, :mod:`datapipe.tools.bench.storage_report` says what the figures mean.
"""
from __future__ import annotations

import sys
from typing import Any

from datapipe.errors import DataError
from datapipe.storage.files import describe, secrets_of
from datapipe.storage.urls import expand_urls, local_path, redact_url, url_scheme
from datapipe.tools.bench.page_cache import drop_page_cache, resident_fraction
from datapipe.tools.bench.storage_reads import Store, measure_reads, measure_stream
from datapipe.tools.bench.storage_report import TABLE_COLUMNS, recommend, rows_for_table
from datapipe.units import format_size

# the measurements, the page cache and the report live in their own modules; their names stay importable from here
__all__ = ["parse_list", "resolve", "run_storage", "drop_page_cache", "resident_fraction", "Store", "measure_reads",
           "measure_stream", "recommend", "rows_for_table", "TABLE_COLUMNS"]


def parse_list(text: str, conv=int) -> list:
    try:
        values = [conv(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"bad list {text!r}: give comma-separated values, e.g. 1,2,4,8 ({e})") from None
    if not values:
        raise ValueError(f"empty list {text!r}")
    return values


def resolve(targets: list[str], storage_options: dict | None = None) -> list[str]:
    """Shard URLs of targets, listed as ShardStream lists them (:func:`datapipe.storage.urls.expand_urls`): files,
    brace specs, folders (the shards their manifest lists, else their shard files)."""
    urls: list[str] = []
    for target in targets:
        try:
            urls += expand_urls(target, storage_options=storage_options)
        except (DataError, ValueError):
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
    bar = tqdm(total=jobs, desc="bench storage", unit="run", file=sys.stderr, disable=None if progress else True)

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
