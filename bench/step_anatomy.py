"""Where a training step's time goes with a loader feeding it: one profiled window per feed, from a trace.

bench/ceiling.py says how far each loader keeps the ResNet-50 step below its data-free ceiling; this
says why. For each feed (the cached batch, ImageLoader variants, the hand-written DALI loop) it
profiles a window of steps (torch.profiler, CPU + CUDA, every thread of the process) and splits
the step, per step:

- ``train_busy_ms``: time the training thread's kernels kept the GPU busy (their union); against
  the cached batch's, the training kernels' own slowdown (SM and memory contention);
- ``train_idle_ms``: the rest of the step, the GPU idle for training (``next()``, launch gaps);
  ``first_kernel_ms``: from the step's start to its first training kernel; ``idle_<phase>_ms``: that
  idle time by where in the step it falls; ``idle_host_late_ms`` / ``idle_queued_ms``: gaps between
  training kernels whose next kernel's launch call had not yet returned (the host was late) or had
  (it waited on the GPU); ``blocked_launch_ms``: training launch calls that took over 0.2 ms;
- ``slowdown_overlapped_ms`` / ``slowdown_alone_ms``: the training kernels' extra time against the
  cached batch's same kernel (matched by position in the step), split by whether a loader kernel
  ran at the same time: contention shows in the first, clocks or memory in both;
- ``loader_kernel_ms`` / ``loader_copy_ms``: GPU time of the kernels and copies no training call
  launched, and their top names;
- ``train_api``: the training thread's CUDA API time per step (and inside ``next()``), by call;
  ``other_api``: the other threads' (DALI's workers, the producer) calls, with the longest one,
  so synchronising calls (allocations, device syncs) show.

    python bench/step_anatomy.py                         # on the GPU machine: bench/results/step_anatomy.json
    python bench/step_anatomy.py --feeds ceiling,imageloader,il_hw0 --steps 12
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP = "anatomy_step"
NEXT = "anatomy_next"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals, lo: float = float("-inf"), hi: float = float("inf")) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


def _overlaps(intervals, s: float, e: float) -> bool:
    return any(a < e and b > s for a, b in intervals)


SYNCING = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree",
           "cudaHostAlloc", "cudaFreeHost", "cudaMallocHost", "cudaHostRegister", "cudaHostUnregister")


PHASES = ("start", "q1", "q2", "q3", "q4", "end")
GAP_US = 50  # idle gaps between training kernels longer than this are attributed (host late / queued)
BLOCKED_US = 200  # a kernel launch call longer than this was blocked (a launch takes 5-20 us)


def _idle_by_phase(busy: list[tuple[float, float]], lo: float, hi: float) -> dict[str, float]:
    """The training streams' idle time (ms) in one step: before its first kernel (``start``), in each
    quarter of the step between kernels (``q1``..``q4``, by where the gap starts), after its last (``end``)."""
    inside = [(max(s, lo), min(e, hi)) for s, e in busy if e > lo and s < hi]
    out = dict.fromkeys(PHASES, 0.0)
    if not inside:
        out["start"] = (hi - lo) / 1e3
        return out
    out["start"] = (inside[0][0] - lo) / 1e3
    out["end"] = (hi - inside[-1][1]) / 1e3
    for (_, e), (s, _) in zip(inside, inside[1:]):
        quarter = min(3, int(4 * (e - lo) / (hi - lo)))
        out[f"q{quarter + 1}"] += (s - e) / 1e3
    return out


def analyse(events: list[dict], reference: dict | None = None, threads: dict | None = None) -> dict:
    """Per-step split of a chrome trace's events (``traceEvents`` of torch.profiler's export).

    The steps are the ``anatomy_step`` annotations of the training thread. The training streams
    are those its launches went to; GPU work on them is the training's (autograd's backward
    thread launches there too), the rest the loader's. ``reference``: the ``kernels`` of the
    cached batch's analysis, to match kernels by position. ``threads``: thread id -> name.
    """
    names = {int(k): v for k, v in (threads or {}).items()}
    steps = sorted((e for e in events if e.get("name") == STEP and e.get("ph") == "X"
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no {STEP!r} annotations in the trace")
    tid = steps[0]["tid"]
    nexts = [e for e in events if e.get("name") == NEXT and e.get("tid") == tid and e.get("cat") == "user_annotation"]
    api = [e for e in events if e.get("cat") in API_CATS and e.get("ph") == "X"]
    main_corr = {e["args"]["correlation"] for e in api if e["tid"] == tid and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"]
    train_streams = {e.get("args", {}).get("stream") for e in gpu
                     if e["cat"] == "kernel" and e.get("args", {}).get("correlation") in main_corr}
    train = sorted((e for e in gpu if e.get("args", {}).get("stream") in train_streams), key=lambda e: e["ts"])
    loader = [e for e in gpu if e.get("args", {}).get("stream") not in train_streams]
    train_corr = {e.get("args", {}).get("correlation") for e in train}
    train_tids = {tid} | {e["tid"] for e in api if e.get("args", {}).get("correlation") in train_corr}
    loader_kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in loader if e["cat"] == "kernel"])
    train_union = _union([(e["ts"], e["ts"] + e["dur"]) for e in train])

    launch_of = {e["args"]["correlation"]: e for e in api if "correlation" in e.get("args", {})}
    blocked = [e for e in api if e["tid"] in train_tids and "Launch" in e["name"] and e["dur"] > BLOCKED_US]
    per_step = defaultdict(list)
    kernels_by_step = []
    for st in steps:
        lo, hi = st["ts"], st["ts"] + st["dur"]
        mine = [e for e in train if lo <= e["ts"] < hi]
        late = queued = 0.0
        for a, b in zip(mine, mine[1:]):
            gap = b["ts"] - max(a["ts"] + a["dur"], lo)
            if gap <= GAP_US:
                continue
            call = launch_of.get(b.get("args", {}).get("correlation"))
            if call is not None and call["ts"] + call["dur"] > a["ts"] + a["dur"]:
                late += gap  # its launch call had not returned when the GPU ran out: the host was late
            else:
                queued += gap  # launched in time, started late: waiting on the GPU (other work, events)
        per_step["idle_host_late_ms"].append(late / 1e3)
        per_step["idle_queued_ms"].append(queued / 1e3)
        per_step["blocked_launch_ms"].append(sum(e["dur"] for e in blocked if lo <= e["ts"] < hi) / 1e3)
        kernels_by_step.append([(e["name"], e["dur"], _overlaps(loader_kernels, e["ts"], e["ts"] + e["dur"]))
                                for e in mine if e["cat"] == "kernel"])
        busy = _length(train_union, lo, hi)
        for phase, ms in _idle_by_phase(train_union, lo, hi).items():
            per_step[f"idle_{phase}_ms"].append(ms)
        per_step["step_ms"].append(st["dur"] / 1e3)
        per_step["train_busy_ms"].append(busy / 1e3)
        per_step["train_idle_ms"].append((st["dur"] - busy) / 1e3)
        per_step["first_kernel_ms"].append(((mine[0]["ts"] - lo) if mine else st["dur"]) / 1e3)
        per_step["loader_overlap_ms"].append(_length(loader_kernels, lo, hi) / 1e3)
    for n in nexts:
        per_step["next_ms"].append(n["dur"] / 1e3)
    out = {k: round(statistics.median(v), 3) for k, v in per_step.items() if v}  # per step, the median
    out["mean"] = {k: round(statistics.fmean(v), 3) for k, v in per_step.items() if v}  # rare stalls show here
    out["steps"] = len(steps)
    out["train_streams"] = sorted(str(s) for s in train_streams)

    n = len(steps)
    span_lo, span_hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    in_span = [e for e in loader if span_lo <= e["ts"] < span_hi]
    by_name: dict[str, float] = defaultdict(float)
    for e in in_span:
        by_name[e["name"][:80]] += e["dur"]
    out["loader_kernel_ms"] = round(sum(e["dur"] for e in in_span if e["cat"] == "kernel") / n / 1e3, 3)
    out["loader_copy_ms"] = round(sum(e["dur"] for e in in_span if e["cat"] != "kernel") / n / 1e3, 3)
    out["loader_top"] = [(k, round(v / n / 1e3, 3)) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]]

    def api_table(calls, within=None) -> dict:
        acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for e in calls:
            if within is not None and not any(a <= e["ts"] < b for a, b in within):
                continue
            a = acc[e["name"]]
            a[0] += 1
            a[1] += e["dur"]
            a[2] = max(a[2], e["dur"])
        rows = sorted(acc.items(), key=lambda kv: -kv[1][1])[:10]
        return {k: {"calls_per_step": round(c / n, 2), "ms_per_step": round(t / n / 1e3, 4), "max_ms": round(m / 1e3, 3)}
                for k, (c, t, m) in rows}

    span = [(span_lo, span_hi)]
    out["train_api"] = api_table([e for e in api if e["tid"] in train_tids], span)
    out["train_api_in_next"] = api_table([e for e in api if e["tid"] == tid],
                                         [(e["ts"], e["ts"] + e["dur"]) for e in nexts])
    out["other_api"] = api_table([e for e in api if e["tid"] not in train_tids], span)
    syncing: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in api:
        if e["name"] in SYNCING and span_lo <= e["ts"] < span_hi:
            a = syncing[f"{e['name']} @ {names.get(e['tid'], 'main' if e['tid'] == tid else e['tid'])}"]
            a[0] += 1
            a[1] += e["dur"]
            a[2] = max(a[2], e["dur"])
    out["syncing_calls"] = {k: {"calls_per_step": round(c / n, 2), "ms_per_step": round(t / n / 1e3, 3),
                                "max_ms": round(m / 1e3, 3)}
                            for k, (c, t, m) in sorted(syncing.items(), key=lambda kv: -kv[1][1])}

    out["kernels"] = kernels_by_step
    if reference:
        extra_over, extra_alone, matched = [], [], 0
        ref = reference["kernels"]
        for ks in kernels_by_step:
            if len(ks) != len(ref):
                continue
            matched += 1
            over = alone = 0.0
            for (name, dur, overlapped), (rname, rdur) in zip(ks, ref):
                if name != rname:
                    break
                if overlapped:
                    over += dur - rdur
                else:
                    alone += dur - rdur
            extra_over.append(over / 1e3)
            extra_alone.append(alone / 1e3)
        if matched:
            out["slowdown_overlapped_ms"] = round(statistics.median(extra_over), 3)
            out["slowdown_alone_ms"] = round(statistics.median(extra_alone), 3)
        out["steps_matched"] = matched
    return out


def reference_kernels(analysis: dict) -> dict:
    """The cached batch's kernels per position in the step: (name, median duration) for the matching."""
    runs = [ks for ks in analysis["kernels"] if ks]
    length = statistics.mode(len(ks) for ks in runs)
    runs = [ks for ks in runs if len(ks) == length]
    return {"kernels": [(runs[0][i][0], statistics.median(ks[i][1] for ks in runs)) for i in range(length)]}


# the loader's calls timed one by one (``--probe``): one that syncs the device shows as a long max
PROBES = ("nvidia.dali.pipeline:Pipeline.run", "nvidia.dali.pipeline:Pipeline.checkpoint",
          "loaders.images.loader:ImageLoader._to_torch", "loaders.images.loader:ImageLoader._prepare",
          "loaders.images.dali_reader:DaliReader._labels", "loaders.images.dali_reader:SampleNumbers.lookup",
          "loaders.images.dali_reader:DaliReader.handed", "datapipe.device.handoff:Retirer.bury",
          "datapipe.device.handoff:wait_and_keep", "numpy:asarray", "torch.cuda:current_stream",
          "torch.cuda:Stream.wait_event", "torch:Tensor.record_stream", "datapipe.device.handoff:Retirer.handed",
          "datapipe.device.handoff:_Pacer.took", "threading:Semaphore.release")


class CallTimer:
    """Wraps functions named ``module:attr.path`` and records each call's duration and thread while on."""

    def __init__(self, targets=PROBES):
        import importlib
        import threading

        self.calls: dict[str, list[tuple[float, str]]] = defaultdict(list)
        self.on = False
        self._undo = []
        for target in targets:
            module, path = target.split(":")
            try:
                owner = importlib.import_module(module)
                *parents, attr = path.split(".")
                for name in parents:
                    owner = getattr(owner, name)
                original = getattr(owner, attr)
            except (ImportError, AttributeError):
                continue

            def wrapper(*a, _orig=original, _key=path, **k):
                if not self.on:
                    return _orig(*a, **k)
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    self.calls[_key].append((time.perf_counter() - t0, threading.current_thread().name))

            setattr(owner, attr, wrapper)
            self._undo.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)

    def summary(self, steps: int) -> dict:
        out = {}
        for key, calls in self.calls.items():
            ms = sorted(d * 1e3 for d, _ in calls)
            out[key] = {"calls_per_step": round(len(ms) / steps, 2), "p50_ms": round(ms[len(ms) // 2], 3),
                        "max_ms": round(ms[-1], 3), "ms_per_step": round(sum(ms) / steps, 3),
                        "threads": sorted({t for _, t in calls})[:3]}
        return out


def profiled(feed, step, *, steps: int, warmup: int, timer: CallTimer | None = None,
             save: str | None = None) -> tuple[list[dict], dict]:
    """Run ``warmup`` then ``steps`` annotated steps under the profiler: the trace's events, thread names."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    it = iter(feed)
    for _ in range(warmup):
        step(next(it))
        torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    if timer is not None:
        timer.on = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with record_function(STEP):
                with record_function(NEXT):
                    batch = next(it)
                step(batch)
                torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
    if timer is not None:
        timer.on = False
    threads = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    close = getattr(it, "close", None)
    if close:
        close()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        if save:  # the trace itself, for a closer look (chrome://tracing, Perfetto)
            import gzip
            import shutil

            with open(path, "rb") as f, gzip.open(save, "wb") as g:
                shutil.copyfileobj(f, g)
        with open(path) as f:
            return json.load(f)["traceEvents"], threads


def main(argv=None) -> dict:
    import torch

    from bench.ceiling import ImageStep, dali_hand, image_loader, replay
    from bench.common import endless, write_result
    from bench.images import ensure_dataset

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/tmp/datapipe-bench-images")
    p.add_argument("--num-images", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--feeds", default="ceiling,imageloader,il_hw0,il_hw1,dali_hand")
    p.add_argument("--probe", action="store_true", help="time the loader's own calls one by one (PROBES)")
    p.add_argument("--save-traces", default="", help="comma list of feeds whose traces to keep (gzip, in --out)")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    args.device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    urls, _ = ensure_dataset(args.data, args.num_images, workers=os.cpu_count() or 1, per_shard=256)
    step = ImageStep(args.device, "resnet50")
    feeds = {
        "imageloader": lambda: endless(image_loader(urls, args)),
        "il_hw0": lambda: endless(image_loader(urls, args, hw_decoder_load=0.0)),
        "il_hw1": lambda: endless(image_loader(urls, args, hw_decoder_load=1.0)),
        "il_hw05": lambda: endless(image_loader(urls, args, hw_decoder_load=0.5)),
        "dali_hand": lambda: dali_hand(urls, args),
    }
    it = iter(image_loader(urls, args))
    cached = tuple(t.clone() for t in next(it))  # the data-free feed replays this batch
    it.close()
    results: dict = {}
    reference = None
    for name in [f for f in args.feeds.split(",") if f]:
        t0 = time.perf_counter()
        feed = replay(cached) if name == "ceiling" else feeds[name]()
        timer = CallTimer() if args.probe and name != "ceiling" else None
        try:
            save = None
            if name in args.save_traces.split(","):
                os.makedirs(args.out or "bench/results", exist_ok=True)
                save = os.path.join(args.out or "bench/results", f"trace_{name}.json.gz")
            events, threads = profiled(feed, step, steps=args.steps, warmup=args.warmup, timer=timer, save=save)
        finally:
            close = getattr(feed, "close", None)
            if close:
                close()
            if timer is not None:
                timer.restore()
        r = analyse(events, reference, threads)
        if timer is not None:
            r["calls"] = timer.summary(args.steps)
        if name == "ceiling":
            reference = reference_kernels(r)
        r.pop("kernels")
        results[name] = r
        print(f"[{name}] {time.perf_counter() - t0:.0f} s: {json.dumps(r)[:1500]}", file=sys.stderr, flush=True)
    out = {"gpu": torch.cuda.get_device_name(args.device), "cpu_count": os.cpu_count(),
           "config": {k: str(v) for k, v in vars(args).items()}, "results": results}
    path = write_result("step_anatomy", out, args.out)
    cols = ("step_ms", "next_ms", "train_busy_ms", "train_idle_ms", *(f"idle_{p}_ms" for p in PHASES),
            "idle_host_late_ms", "idle_queued_ms", "blocked_launch_ms",
            "slowdown_overlapped_ms", "slowdown_alone_ms", "loader_kernel_ms", "loader_copy_ms")
    print("feed".ljust(12) + "".join(c[:14].rjust(15) for c in cols))
    for name, r in results.items():
        print(name.ljust(12) + "".join(str(r.get(c, "-")).rjust(15) for c in cols))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
