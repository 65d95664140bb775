"""Which host activity stalls a training thread's kernel launches: launch-call times beside each one.

ImageLoader's remaining loss against the data-free ceiling is mostly GPU idle while the training
threads' launch calls are blocked (README, "Where the rest goes"), and a few rare 2.7-4.7 ms stalls
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
- ``imageloader``: an ``ImageLoader`` (defaults) consumed as fast as it goes; ``imageloader_novmm``
  the same with ``DALI_USE_VMM=0``; ``imageloader_nommap`` with ``readers.webdataset(dont_use_mmap=True)``;
  ``imageloader_hw0`` with ``hw_decoder_load=0.0``.

Per activity, for the launch as Python sees it (``call_*``: GIL waits included) and, on CUDA, for the
launch call inside the CUDA API (``driver_*``: from torch.profiler, the GIL left out): count, p50 / p99 /
p99.9 (us), the longest (ms), the calls over 0.2 ms and over 1 ms (per 10k), and how many times the
activity ran.

    python bench/launch_stalls.py                          # the H200 run: bench/results/launch_stalls.json
    python bench/launch_stalls.py --activities none,shm_free --seconds 3
    python bench/launch_stalls.py --quick                  # CPU smoke check (a CPU op stands for the launch)
"""
from __future__ import annotations

import argparse
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
CUDA_ONLY = ("pinned_free", "device_free", "h2d_threads")
IMAGE = ("imageloader", "imageloader_novmm", "imageloader_nommap", "imageloader_hw0")
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
        try:
            while not stop.is_set():
                for _ in loader:
                    yield
                    if stop.is_set():
                        break
        finally:
            loader.close()


def activity(name: str, stop: threading.Event, args):
    """The generator that runs ``name`` once per ``next()`` (a batch, for the image loaders)."""
    if name == "none":
        return iter(())
    if name in IMAGE:
        return _imageloader(stop, args, row=name, **({"hw_decoder_load": 0.0} if name == "imageloader_hw0" else {}))
    return globals()[f"_{name}"](stop, args)


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

    def background():
        try:
            for _ in activity(name, stop, args):
                done[0] += 1
                if not stop.is_set():
                    time.sleep(args.gap_s)
        except Exception as e:  # noqa: BLE001 - reported with the result
            errors.append(repr(e)[:300])

    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    time.sleep(args.settle_s)  # the activity under way (an image loader's pipeline built, its first batches out)
    times = []
    profiler = _profiler() if cuda else None
    end = time.perf_counter() + args.seconds
    with profiler if profiler is not None else contextlib.nullcontext():
        while time.perf_counter() < end:
            for _ in range(64):
                t0 = time.perf_counter()
                x.add_(1)
                times.append(time.perf_counter() - t0)
            if cuda:
                torch.cuda.synchronize()
    stop.set()
    worker.join(timeout=30)
    out = {"activity": name, **spread("call", times)}
    if profiler is not None:  # the driver's own time per launch, whatever the GIL did
        out.update(spread("driver", driver_launch_times(profiler)))
    return {**out, "activity_runs": done[0], **({"error": errors[0]} if errors else {})}


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def driver_launch_times(prof) -> list[float]:
    """Seconds of each launch call (CUDA runtime/driver API) the timed thread made: the thread of the
    ``aten::add_`` ops."""
    from collections import Counter

    events = prof.events()
    main = Counter(e.thread for e in events if e.name == "aten::add_").most_common(1)
    if not main:
        return []
    tid = main[0][0]
    return [e.time_range.elapsed_us() / 1e6 for e in events if e.name in LAUNCHES and e.thread == tid]


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
    ap.add_argument("--seconds", type=float, default=6.0, help="timed launches per activity")
    ap.add_argument("--settle-s", type=float, default=4.0, help="the activity runs this long before timing")
    ap.add_argument("--gap-s", type=float, default=0.005, help="pause between two runs of an activity")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the activities, interleaved")
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
    rows = []
    passthrough = ["--seconds", str(args.seconds), "--settle-s", str(args.settle_s), "--gap-s", str(args.gap_s),
                   "--device", args.device, "--data", args.data, "--num-images", str(args.num_images),
                   "--scratch", args.scratch]
    for r in range(args.rounds):
        for name in names:
            print(f"[{name}] round {r} ...", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, *passthrough],
                                  capture_output=True, text=True, env=child_env(name),
                                  timeout=args.seconds + args.settle_s + 300)
            line = (proc.stdout.strip().splitlines() or [""])[-1]
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = {"activity": name, "error": (proc.stderr or proc.stdout)[-500:]}
            rows.append({"round": r, **row})
    device = args.device
    gpu = "cpu"
    if device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "cpu_count": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if k != "child"},
              "rows": rows}
    path = write_result("launch_stalls", result, args.out)
    print(table(rows, ["activity", "round", "call_n", "call_p50_us", "call_p999_us", "call_max_ms", "call_over_0.2ms_per_10k",
                       "call_over_1ms_per_10k", "driver_p999_us", "driver_max_ms", "driver_over_0.2ms_per_10k",
                       "driver_over_1ms_per_10k", "activity_runs"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
