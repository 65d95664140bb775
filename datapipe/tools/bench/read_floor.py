"""Where a one-process read's time goes: the CPU a sample costs at each layer, from a bare ``pread`` up to the peers' rows.

The same ~100 KB JPEGs (``datapipe.tools.bench.peer_images``), read by one process in the page cache, each way in a
fresh Python process, ``epochs`` passes each (the first is a fresh process's first epoch), batches of 256 held
until the next is full (as a consumer holds the batch it trains on):

- ``pread``: the floor, a bare ``os.pread`` per value over ``datapipe shard``'s tars, in file order;
- ``mmap_keep``: the same values copied out of a memory map of each shard (mapped afresh every pass, as a reader
  opens its shards), ``bytes(view[a:b])``: the copy in user space instead of the kernel's;
- ``stream``: ``ShardStream(shuffle=True)`` over the same tars (its reader, member table, shuffle buffer);
- ``stream_buffer``: the same stream with the peers' sample shuffle buffer (200): ~20 MB more held at 100 KB, which
  a host whose last-level cache held the rest may feel in the kernel's copy;
- ``stream_mmap``: the same stream with each value copied out of the reader's memory map (``bytes`` of a slice,
  the pages behind let go as its zero-copy views do) instead of a ``pread``: a probe of that read, not an option;
- ``loader``: the peers benchmark's datapipe row, ``loaders.DataLoader`` over that stream, 0 workers;
- ``loader_w4`` and ``loader_w8``: ``loader`` with 4 or 8 worker processes (the peers' worker rows): whether the
  main process caps them shows in ``main_busy``, the share of the pass its main thread spent on the CPU;
  ``loader_w8_ahead``: 8 workers that each read ahead in 2 threads (``StorageOptions(read_threads=2)``; workers
  read a ``pread`` a value by default), whether the workers' own reads are what holds them;
  ``loader_w4_copied`` and ``loader_w8_copied``: 4 or 8 workers whose raw leaves travel copied into their
  shared-memory segments, not read out of their memory (``loaders.dataloader.vmread`` off): the A/B of that read;
  ``loader_w4_serial`` and ``loader_w8_serial``: the main process reading one batch at a time, not the next one
  ahead in a thread of the pass (``loaders.dataloader.unpacking`` off): the A/B of that; ``loader_w4_deep`` and
  ``loader_w8_deep``: that thread two batches ahead (``unpacking.AHEAD = 2``, three batches' reads at once);
- ``stream_pread`` and ``loader_pread``: ``stream`` and ``loader`` with ``StorageOptions(read_threads=0)``, a
  ``pread`` per value, against their default read ahead in threads (:mod:`datapipe.read.spans`);
- ``files``: torch's loose-files way by hand, ``open`` + ``read`` per file in a shuffled order;
- ``torch``: the peers benchmark's torch row, torch's ``DataLoader`` over a files ``Dataset``, 0 workers.

Ways ending in ``_keep`` first keep glibc's freed memory (:func:`datapipe.read.heap.keep_freed_memory`); ``stream``
and ``loader`` do it themselves (ShardStream's default), ``stream_plain`` is the stream with
``StorageOptions(keep_freed_memory=False)``, and the other ways run with the allocator as Python leaves it. Per way
and pass: samples/s, per sample the process's user and system CPU (us; its threads, not its worker processes), the
main thread's CPU (us) and minor page faults, the time to the first item (``first_s``: a fresh worker pass's
start) and the rate after it (``after_first_per_s``), and the CPU and NUMA node it ended on; the summary has each
way's best pass and its median. A way against the one it builds on (``stream`` on ``pread_keep``, ``loader`` on
``stream``, ``torch`` on ``files``) is what that layer costs.

``python bench/peers.py --floor`` runs it (``bench/results/read_floor.json``); every way runs in a fresh process
(``python -m datapipe.tools.bench.read_floor WAY SPEC_JSON EPOCHS`` prints its passes as JSON).
"""
from __future__ import annotations

import datetime
import json
import os
import random
import resource
import subprocess
import sys
import time

WAYS = ("pread", "pread_keep", "mmap_keep", "stream_plain", "stream", "stream_pread", "stream_buffer", "stream_mmap",
        "loader", "loader_pread", "loader_w4", "loader_w8", "loader_w8_ahead", "loader_w4_copied", "loader_w8_copied",
        "loader_w4_serial", "loader_w8_serial", "loader_w4_deep", "loader_w8_deep", "files", "files_keep", "torch")
BUFFER = 200  # the peers' datapipe row's (and the README's) sample shuffle buffer
BATCH = 256


def prepare(root: str, num_images: int) -> dict:
    """The image folder and ``datapipe shard``'s tars of it under ``root`` (made once)."""
    from datapipe.tools.bench.peer_images import make_image_folder
    from datapipe.tools.bench.peer_writers import write

    images = make_image_folder(os.path.join(root, "images"), num_images=num_images, num_classes=1)
    tars = os.path.join(root, "datapipe")
    if not os.path.exists(os.path.join(tars, "manifest.json")):
        write("datapipe", images, tars, workers=os.cpu_count() or 1)
        os.sync()
    return {"images": images, "tars": tars}


def _usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _where() -> dict:
    """The CPU this process last ran on and its NUMA node (the kernel's copy out of the page cache runs at the speed
    of the memory between them: on the GPU host the same way read 13-15 us or 19-22 us of system time a sample,
    process by process)."""
    try:
        with open("/proc/self/stat") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"
        nodes = [n for n in os.listdir(f"/sys/devices/system/cpu/cpu{cpu}") if n.startswith("node")]
        return {"cpu": cpu, "node": int(nodes[0][4:]) if nodes else None}
    except (OSError, ValueError, IndexError):
        return {"cpu": None, "node": None}


def numa_nodes() -> int | None:
    try:
        return len([n for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit() and n.startswith("node")])
    except OSError:
        return None


def timed(samples, *, batches=False) -> dict:
    """One pass: samples/s and, per sample, user and system CPU (us) and minor faults; the time to the first item
    (``first_s``: worker starts included) and the rate after it. ``batches``: the loader hands out batches of
    ``(keys, values, labels)`` itself."""
    u0, s0, f0 = _usage()
    m0 = time.thread_time()
    t0, n, batch, held, first = time.perf_counter(), 0, [], None, None
    for item in samples:
        if first is None:
            first, n_first = time.perf_counter(), (len(item[0]) if batches else 1)
        if batches:
            held = item  # noqa: F841 (the consumer holds the last batch)
            n += len(item[0])
            continue
        batch.append(item)
        n += 1
        if len(batch) == BATCH:
            held, batch = batch, []  # noqa: F841
    end = time.perf_counter()
    seconds = end - t0
    main = time.thread_time() - m0
    u1, s1, f1 = _usage()
    after = n - n_first if first is not None else 0
    n = max(n, 1)
    return {"samples": n, "samples_per_s": round(n / seconds), "user_us": round((u1 - u0) / n * 1e6, 1),
            "sys_us": round((s1 - s0) / n * 1e6, 1), "main_thread_us": round(main / n * 1e6, 1),
            "main_busy": round(main / seconds, 2), "faults": round((f1 - f0) / n, 2),
            "first_s": round((end if first is None else first) - t0, 4),
            "after_first_per_s": round(after / (end - first)) if after and end > first else None, **_where()}


def _shards(tars: str) -> list[tuple[int, object]]:
    """``(fd, member table)`` of every tar, in name order: read once, before any pass is timed."""
    from datapipe.tar import member_table

    out = []
    for name in sorted(f for f in os.listdir(tars) if f.endswith(".tar")):
        fd = os.open(os.path.join(tars, name), os.O_RDONLY)
        table = member_table.load(fd, os.fstat(fd).st_size)
        if table is None:
            raise RuntimeError(f"{name} has no member table (not written by this datapipe?)")
        out.append((fd, table))
    return out


def _preads(shards):
    """Every sample's values, one ``pread`` each, in file order."""
    for fd, table in shards:
        for members in table.members:
            yield [os.pread(fd, size, offset) for _, offset, size in members]


def _mapped(shards):
    """Every sample's values copied out of a fresh memory map of its shard, in file order."""
    import mmap

    for fd, table in shards:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            for members in table.members:
                yield [bytes(view[offset:offset + size]) for _, offset, size in members]
            view.release()


def _read_values_from_the_map() -> None:
    """(This process only) the reader's zero-copy values become copies out of its memory map: ``zero_copy=True``
    then reads each value as ``bytes(map[a:b])`` instead of a ``pread``."""
    from datapipe.read import segments

    def copy_of(reader):
        def read(offset: int, size: int) -> bytes:
            data = reader.mm[offset:offset + size]
            reader.offset = offset + size
            if reader.offset >= reader._next_release:
                reader._release()  # the pages behind are let go, as with views
            return data
        return read

    segments._view_of = copy_of


def passes(way: str, data: dict, epochs: int) -> list[dict]:
    """``epochs`` passes of one way, in this process."""
    if way.endswith("_keep"):
        from datapipe.read.heap import keep_freed_memory

        keep_freed_memory()
    if way == "mmap_keep" or way.startswith("pread"):
        shards = _shards(data["tars"])
        read = _mapped if way == "mmap_keep" else _preads
        return [timed(read(shards)) for _ in range(epochs)]
    if way.startswith("files"):
        folder = os.path.join(data["images"], sorted(os.listdir(data["images"]))[0])
        names = [os.path.join(folder, n) for n in sorted(os.listdir(folder))]

        def read_all():
            for i in random.sample(range(len(names)), len(names)):
                with open(names[i], "rb") as f:
                    yield f.read()
        return [timed(read_all()) for _ in range(epochs)]
    if way.startswith("stream"):
        from datapipe import ShardStream
        from datapipe.read.options import StorageOptions

        if way == "stream_mmap":
            _read_values_from_the_map()
        buffer = BUFFER if way == "stream_buffer" else 0
        stream = ShardStream(data["tars"], shuffle=True, seed=0, shuffle_buffer=buffer,
                             storage=StorageOptions(keep_freed_memory=way != "stream_plain",
                                                    zero_copy=way == "stream_mmap",
                                                    read_threads=0 if way == "stream_pread" else None))
        out = []
        for epoch in range(epochs):
            stream.set_epoch(epoch)
            out.append(timed(iter(stream)))
        return out
    from datapipe.tools.bench.peer_readers import open_loader, set_epoch_of

    from datapipe.read.options import StorageOptions

    ours = way.startswith("loader")
    if way.endswith("_copied"):
        from loaders.dataloader import vmread

        vmread.ENABLED = False  # this process (the way's own) only
    if way.endswith("_serial"):
        from loaders.dataloader import unpacking

        unpacking.ENABLED = False  # this process (the way's own) only
    if way.endswith("_deep"):
        from loaders.dataloader import unpacking

        unpacking.AHEAD = 2  # this process (the way's own) only
    workers = int(way[len("loader_w"):].split("_")[0]) if way.startswith("loader_w") else 0
    threads = {"loader_pread": 0, "loader_w8_ahead": 2}.get(way)
    loader = open_loader("datapipe" if ours else "torch", data["tars"] if ours else data["images"], batch_size=BATCH,
                         workers=workers, seed=0,
                         storage=StorageOptions(read_threads=threads) if threads is not None else None)
    out = []
    for epoch in range(epochs):
        set_epoch_of(loader, epoch)
        out.append(timed(loader, batches=True))
    return out


def run_floor(root: str, *, num_images: int, epochs: int = 3, rounds: int = 3, ways=WAYS, log=print) -> dict:
    """Every way in ``rounds`` interleaved rounds (the order reversed every other round), each in a fresh process:
    the rows, the best pass per way and epoch (``summary``) and the machine."""
    from datapipe.tools.bench.cli import environment

    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        raise ValueError(f"unknown ways {', '.join(unknown)}: choose from {', '.join(WAYS)}")
    t0 = time.perf_counter()
    data = prepare(os.path.join(root, str(num_images)), num_images)
    log(f"data ready ({time.perf_counter() - t0:.1f} s)")
    rows = []
    for rnd in range(rounds):
        for way in ways if rnd % 2 == 0 else ways[::-1]:
            run = subprocess.run([sys.executable, "-m", "datapipe.tools.bench.read_floor", way, json.dumps(data),
                                  str(epochs)], capture_output=True, text=True, timeout=600)
            if run.returncode:
                rows.append({"way": way, "round": rnd, "error": (run.stderr.strip().splitlines() or ["?"])[-1]})
                log(f"[{way} round {rnd}] failed: {rows[-1]['error']}")
                continue
            for epoch, r in enumerate(json.loads(run.stdout.strip().splitlines()[-1])):
                rows.append({"way": way, "round": rnd, "epoch": epoch + 1, **r})
            log(f"[{way} round {rnd}] " + ", ".join(
                f"{r['samples_per_s']:,} (main busy {r['main_busy']}, first {r['first_s']} s, "
                f"then {r['after_first_per_s']})"
                for r in rows[-epochs:]))
    summary = []
    for way in ways:
        for epoch in range(1, epochs + 1):
            got = [r for r in rows if r["way"] == way and r.get("epoch") == epoch]
            if got:
                best = max(got, key=lambda r: r["samples_per_s"])
                rates = sorted(r["samples_per_s"] for r in got)
                kept = ("samples_per_s", "user_us", "sys_us", "main_thread_us", "main_busy", "faults", "first_s",
                        "after_first_per_s")
                summary.append({"way": way, "epoch": epoch, **{k: best[k] for k in kept},
                                "median_samples_per_s": rates[len(rates) // 2], "min_samples_per_s": rates[0]})
    return {"what": "one process's read of ~100 KB JPEGs, per layer (bench/peers.py --floor)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "numa_nodes": numa_nodes(), "kernel": os.uname().release,
            "environment": environment(),
            "config": {"num_images": num_images, "epochs": epochs, "rounds": rounds, "batch": BATCH},
            "rows": rows, "summary": summary}


if __name__ == "__main__":
    way, spec, epochs = sys.argv[1:4]
    print(json.dumps(passes(way, json.loads(spec), int(epochs))))
