"""What a ``datapipe bench storage`` run's figures say: the recommendation (what to set where), the warning
when the data set is too small for them to hold, and the rows of the printed table."""
from __future__ import annotations

from datapipe.units import format_size
from datapipe.words import counted

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


ZERO_COPY_MARGIN = 1.1  # zero_copy is advised only where it read this much faster than the copy in the same run


def _stream_advice(result: dict) -> str:
    """What the ShardStream pass says: its rate, and ``zero_copy=True`` only where this run measured it faster."""
    copy, zc = result["stream"].get("copy"), result["stream"].get("zero_copy")
    if copy and zc and copy["mb_per_s"] > 0 and zc["mb_per_s"] > 0:
        if zc["mb_per_s"] >= ZERO_COPY_MARGIN * copy["mb_per_s"]:
            return (f". ShardStream parses {zc['mb_per_s']:.0f} MB/s in one process with "
                    f"storage=StorageOptions(zero_copy=True), {zc['mb_per_s'] / copy['mb_per_s']:.2f}x the copy's "
                    f"{copy['mb_per_s']:.0f} MB/s here")
        return (f". ShardStream parses {copy['mb_per_s']:.0f} MB/s in one process; zero_copy=True measured "
                f"{zc['mb_per_s']:.0f} MB/s, so the copy (the default) is as fast or faster here: keep it")
    st = zc or copy
    if st and st["mb_per_s"] > 0:
        return f". ShardStream parses {st['mb_per_s']:.0f} MB/s in one process"
    return ""


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
            text += (f"; with {counted(shards, 'shard')} at most {counted(shards, 'reader')} "
                     f"{'is' if shards == 1 else 'are'} busy: write more, smaller shards")
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
    text += _stream_advice(result)
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
