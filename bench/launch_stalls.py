"""Which host activity stalls a training thread's kernel launches: launch-call times beside each one.

ImageLoader's remaining loss against the data-free ceiling is mostly GPU idle while the training
threads' launch calls are blocked (bench/HISTORY.md, "Where the rest goes"), and a few rare 2.7-4.7 ms stalls
(a DALI thread's copy call and a training launch blocked together) weigh most. Throughput ratios
move by +-0.3% from row to row; counting blocked launch calls is a far finer test. Each activity
runs in a fresh process: its main thread launches a tiny kernel in a loop (synchronising every 64
launches, untimed) and times every launch call, while a second thread repeats the activity:

- ``none``: nothing (the baseline);
- ``shm_free``: make, fill and free a 19 MB shared-memory tensor (a worker's batch: README,
  "Pinning in the producer"); ``anon_free``: the same for a private 100 MB tensor;
- ``file_unmap``: map a 100 MB file, read every page, unmap it (a memory-mapped shard);
- ``pinned_free``: allocate and free 8 MB of pinned memory (``cudaHostAlloc`` / ``cudaFreeHost``);
- ``device_free``: allocate 64 MB on the device and release the cache (``cudaMalloc`` / ``cudaFree``);
- ``h2d_threads``: 8 threads copying 128 KB pinned buffers to the device, each with an event
  record and sync (nvJPEG's per-image pattern);
- ``imageloader``: an ``ImageLoader`` (defaults) consumed at a training loop's pace
  (``--batches-per-s``); ``imageloader_novmm`` the same with ``DALI_USE_VMM=0``;
  ``imageloader_nommap`` with ``readers.webdataset(dont_use_mmap=True)``; ``imageloader_hw0`` with
  ``hw_decoder_load=0.0``.

Per activity, for the launch as Python sees it (``call_*``: GIL waits included), for a CPU op timed
right after each launch (``host_op_*``: the same Python path without CUDA; its stalls are the GIL's or
the OS's) and, on CUDA, for the launch call inside the CUDA API (``driver_*``: from torch.profiler,
the GIL left out; the profile gives all threads' API calls one thread id, so the timed thread's
launches are those inside its ``aten::add_`` spans): count, p50 / p99 / p99.9 (us), the longest (ms),
the calls over 0.2 ms and over 1 ms (per 10k), and how many times the activity ran. ``other_calls``:
the other threads' CUDA API calls in the timed window (count, total ms), ``beside_long_launches``:
which of them overlapped the timed launches over 1 ms.

    python bench/launch_stalls.py                          # the H200 run: bench/results/launch_stalls.json
    python bench/launch_stalls.py --activities none,shm_free --seconds 3
    python bench/launch_stalls.py --quick                  # CPU smoke check (a CPU op stands for the launch)
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datapipe.units import percentiles  # noqa: E402

ACTIVITIES = ("none", "shm_free", "anon_free", "file_unmap", "pinned_free", "device_free", "h2d_threads",
              "imageloader", "imageloader_novmm", "imageloader_nommap", "imageloader_hw0")
IMAGE = ("imageloader", "imageloader_novmm", "imageloader_nommap", "imageloader_hw0")
IMAGE_SETTLE_S = 12.0
BLOCKED_S = 2e-4
LONG_S = 1e-3


# ---- the activities (run in a background thread of the child until ``stop``) ------------------------
def _shm_free(stop, args):
    import torch

    n = 128 * 3 * 224 * 224
    while not stop.is_set():
        t = torch.empty(n, dtype=torch.uint8).share_memory_()
        t.fill_(1)
        del t
        yield


def _anon_free(stop, args):
    import torch

    while not stop.is_set():
        t = torch.empty(100 << 20, dtype=torch.uint8)
        t.fill_(1)
        del t
        yield


def _file_unmap(stop, args):
    import mmap

    path = os.path.join(args.scratch, "launch_stalls_100mb.bin")
    if not os.path.exists(path) or os.path.getsize(path) != 100 << 20:
        with open(path, "wb") as f:
            f.write(os.urandom(100 << 20))
    while not stop.is_set():
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sum(m[i] for i in range(0, len(m), 4096))
        m.close()
        yield


def _pinned_free(stop, args):
    import torch

    while not stop.is_set():
        t = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
        del t
        torch._C._host_emptyCache()
        yield


def _device_free(stop, args):
    import torch

    while not stop.is_set():
        t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del t
        torch.cuda.empty_cache()
        yield


def _h2d_threads(stop, args):
    import torch

    def copier():
        src = torch.empty(128 << 10, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty_like(src, device="cuda")
        stream = torch.cuda.Stream()
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                dst.copy_(src, non_blocking=True)
                event.record(stream)
                event.synchronize()

    threads = [threading.Thread(target=copier, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    while not stop.is_set():
        time.sleep(0.01)
        yield
    for t in threads:
        t.join()


def _imageloader(stop, args, row: str = "imageloader", **options):
    from bench.ceiling import dali_pipeline_row
    from bench.images import ensure_dataset
    from loaders import ImageLoader

    urls, _ = ensure_dataset(args.data, args.num_images, workers=os.cpu_count() or 1, per_shard=256)
    with dali_pipeline_row(row):  # a row's DALI settings (``imageloader_nommap``: shards not memory-mapped)
        loader = ImageLoader(urls, batch_size=256, image_size=224, device="cuda", **options)
        while not stop.is_set():
            batches = iter(loader)
            try:
                for _ in batches:
                    yield
                    if stop.is_set():
                        break
            finally:
                batches.close()


def activity(name: str, stop: threading.Event, args):
    """The generator that runs ``name`` once per ``next()`` (a batch, for the image loaders)."""
    if name == "none":
        return iter(())
    if name in IMAGE:
        return _imageloader(stop, args, row=name, **({"hw_decoder_load": 0.0} if name == "imageloader_hw0" else {}))
    return globals()[f"_{name}"](stop, args)


def settle(name: str, args) -> float:
    """Seconds ``name`` runs before the timing starts: an image loader's pipeline built and its
    hardware decoder started take over 7 s on the H200."""
    return max(args.settle_s, IMAGE_SETTLE_S) if name in IMAGE else args.settle_s


# ---- one activity, in this (child) process ------------------------------------------------------------
def measure(name: str, args) -> dict:
    """Launch-call times of the main thread while ``name`` runs beside it (see the module docstring)."""
    import torch

    from datapipe.device.queues import widen_hardware_queues

    widen_hardware_queues()  # as a training script that imports loaders.images: before CUDA starts, every activity
    cuda = args.device == "cuda"
    x = torch.zeros(16, device=args.device)
    stop = threading.Event()
    done = [0]
    errors: list[str] = []

    # an image loader paced at a training loop's rate (ResNet-50 on the H200: ~18 batches of 256 a second)
    gap = 1.0 / args.batches_per_s if name in IMAGE and args.batches_per_s > 0 else args.gap_s

    def background():
        try:
            for _ in activity(name, stop, args):
                done[0] += 1
                if not stop.is_set():
                    time.sleep(gap)
        except Exception as e:  # noqa: BLE001 - reported with the result
            errors.append(repr(e)[:300])

    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    time.sleep(settle(name, args))  # the activity under way
    times, host_times = [], []
    host = torch.zeros(16)
    profiler = _profiler() if cuda else None
    with profiler if profiler is not None else contextlib.nullcontext():
        end = time.perf_counter() + args.seconds  # the profiler's start-up (seconds, at times) left out
        while time.perf_counter() < end:
            for _ in range(args.group):
                t0 = time.perf_counter()
                x.add_(1)
                t1 = time.perf_counter()
                host.mul_(1)  # the same Python and dispatcher path, no CUDA: its stalls are the GIL's or the OS's
                t2 = time.perf_counter()
                times.append(t1 - t0)
                host_times.append(t2 - t1)
            if cuda:
                torch.cuda.synchronize()
            time.sleep(args.pause_ms / 1e3)  # fewer, spread-out launches: the profile stays small to read
    stop.set()
    worker.join(timeout=30)
    out = {"activity": name, **spread("call", times), **spread("host_op", host_times)}
    if profiler is not None:  # the driver's own time per launch, whatever the GIL did
        split = split_launches(api_records(profiler))
        out.update(spread("driver", split.pop("times")))
        out.update(split)
    return {**out, "activity_runs": done[0], **({"error": errors[0]} if errors else {})}


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
TIMED_OP = "aten::add_"


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def api_records(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the profile's CUDA API calls (names from ``cu``) and of
    the timed op. The profile gives every thread's API calls one thread id (the H200 run counted DALI's
    launches as the timed thread's), so the timed thread's launches are told apart by time instead:
    a launch inside a ``TIMED_OP``'s span (see :func:`split_launches`)."""
    out = []
    for e in prof.events():
        if e.name == TIMED_OP or e.name.startswith("cu"):
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def split_launches(records, top: int = 12) -> dict:
    """The timed thread's launch calls (a launch inside a timed op's span; where an op's span holds more
    than one, another thread's launch fell inside it: the op's first is taken, the op counted ``ambiguous``) and
    every other API call: per name the count and total ms (the ``top`` by total time), and which names
    overlapped the timed launches that took over 1 ms (``beside_long_launches``: how many of them each)."""
    from collections import Counter, defaultdict

    ops: dict[tuple[float, float], list] = defaultdict(list)
    spans = sorted({(s, e) for name, s, e in records if name == TIMED_OP})  # one thread's ops: no overlaps
    starts = [s for s, _ in spans]
    for r in records:
        # by time, not by the profile's parent: another thread's call that overlaps the op's end breaks
        # the profile's nesting (it pops the op), at the very moments that matter here
        if r[0] in LAUNCHES:
            i = bisect.bisect_right(starts, r[1]) - 1  # the last op starting at or before the launch
            if i >= 0 and r[2] <= spans[i][1]:
                ops[spans[i]].append(r)
    mine = [sorted(v, key=lambda r: r[1])[0] for v in ops.values()]
    ambiguous = sum(len(v) > 1 for v in ops.values())
    mine_ids = {id(r) for r in mine}
    others = [r for r in records if r[0] != TIMED_OP and id(r) not in mine_ids]
    count, total = Counter(), defaultdict(float)
    for name, s, e in others:
        count[name] += 1
        total[name] += (e - s) / 1e3
    calls = {n: {"n": count[n], "ms": round(total[n], 2)} for n in sorted(total, key=total.get, reverse=True)[:top]}
    long = [r for r in mine if r[2] - r[1] > LONG_S * 1e6]
    beside = Counter()
    for _, s, e in long:
        beside.update({name for name, s2, e2 in others if s2 < e and e2 > s})
    return {"times": [(e - s) / 1e6 for _, s, e in mine], "ambiguous": ambiguous, "other_calls": calls,
            "long_launches": len(long), "beside_long_launches": dict(beside.most_common(top))}


def spread(prefix: str, times: list[float]) -> dict:
    """Count, p50 / p99 / p99.9 (us), longest (ms), and calls over 0.2 ms and 1 ms (per 10k) of ``times``."""
    if not times:
        return {f"{prefix}_n": 0}
    n = len(times)
    q = percentiles(times, qs=(50, 99, 99.9), scale=1e6, digits=1)
    return {f"{prefix}_n": n, f"{prefix}_p50_us": q["p50"], f"{prefix}_p99_us": q["p99"],
            f"{prefix}_p999_us": q["p99.9"], f"{prefix}_max_ms": round(max(times) * 1e3, 3),
            f"{prefix}_over_0.2ms_per_10k": round(1e4 * sum(t > BLOCKED_S for t in times) / n, 2),
            f"{prefix}_over_1ms_per_10k": round(1e4 * sum(t > LONG_S for t in times) / n, 2)}


def child_env(name: str) -> dict:
    env = dict(os.environ)
    if name == "imageloader_novmm":
        env["DALI_USE_VMM"] = "0"
    return env


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--activities", default=",".join(ACTIVITIES))
    ap.add_argument("--seconds", type=float, default=3.0, help="timed launches per activity")
    ap.add_argument("--settle-s", type=float, default=4.0, help="the activity runs this long before timing")
    ap.add_argument("--gap-s", type=float, default=0.005, help="pause between two runs of an activity")
    ap.add_argument("--batches-per-s", type=float, default=18.0,
                    help="the image loaders' pace (a pause of 1/N s after each batch; 0: as fast as they go)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the activities, interleaved")
    ap.add_argument("--group", type=int, default=16, help="launches between two synchronisations")
    ap.add_argument("--pause-ms", type=float, default=2.0, help="pause after each synchronisation")
    ap.add_argument("--child-timeout-s", type=float, default=60.0, help="a child's limit beyond its timed run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", default="/tmp/datapipe-bench-images")
    ap.add_argument("--num-images", type=int, default=20000)
    ap.add_argument("--scratch", default="/tmp")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="CPU smoke check: CPU activities, a CPU op, 1 s each")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.seconds, args.settle_s = "cpu", 1.0, 0.3
        args.activities = "none,shm_free,anon_free,file_unmap"
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return {}
    from bench.common import table, write_result

    names = [a for a in args.activities.split(",") if a]
    unknown = [a for a in names if a not in ACTIVITIES]
    if unknown:
        ap.error(f"unknown activities {unknown}; known: {', '.join(ACTIVITIES)}")
    device = args.device
    gpu = "cpu"
    if device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name()
    rows = []
    result = {"gpu": gpu, "cpu_count": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if k != "child"},
              "rows": rows}
    passthrough = ["--seconds", str(args.seconds), "--settle-s", str(args.settle_s), "--gap-s", str(args.gap_s),
                   "--batches-per-s", str(args.batches_per_s),
                   "--group", str(args.group), "--pause-ms", str(args.pause_ms),
                   "--device", args.device, "--data", args.data, "--num-images", str(args.num_images),
                   "--scratch", args.scratch]
    for r in range(args.rounds):
        for name in names:
            print(f"[{name}] round {r} ...", file=sys.stderr, flush=True)
            try:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, *passthrough],
                                      capture_output=True, text=True, env=child_env(name),
                                      timeout=args.seconds + settle(name, args) + args.child_timeout_s)
                line = (proc.stdout.strip().splitlines() or [""])[-1]
                row = json.loads(line)
            except subprocess.TimeoutExpired:
                row = {"activity": name, "error": f"timed out after {args.child_timeout_s} s beyond its run"}
            except json.JSONDecodeError:
                row = {"activity": name, "error": (proc.stderr or proc.stdout)[-500:]}
            rows.append({"round": r, **row})
            write_result("launch_stalls", result, args.out)  # after each row: a cut-short run keeps its rows
    path = write_result("launch_stalls", result, args.out)
    print(table(rows, ["activity", "round", "call_n", "call_p50_us", "call_p999_us", "call_max_ms",
                       "call_over_0.2ms_per_10k", "call_over_1ms_per_10k", "host_op_over_1ms_per_10k",
                       "driver_p999_us", "driver_max_ms", "driver_over_0.2ms_per_10k", "driver_over_1ms_per_10k",
                       "activity_runs"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
