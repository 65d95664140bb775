"""Device prefetch: host-to-device bandwidth and data-wait in a training loop.

(a) Bandwidth for 64/128/256 MB batches, all in the same run: pageable ``x.to(cuda)``, the pinned
    ceiling (``pinned.to(cuda, non_blocking=True)`` + sync), and DevicePrefetcher fed pageable
    tensors (staged through its pinned pool) and pinned tensors (copied directly).
(b) A training loop whose step is a bf16 matmul chain of known GPU time (~20 ms, ending with a
    host sync as ``loss.item()`` does), fed by ``torch.utils.data.DataLoader(pin_memory=True)`` +
    ``.to(cuda, non_blocking=True)`` vs ``loaders.DataLoader(device="cuda")`` with the same workers,
    from a dataset whose per-batch CPU cost is known: one case the host keeps up with, one it
    cannot. Each round measures the ceiling, the same loop fed one cached device batch, before and
    after the loaders, and each loader's rate is reported as a ratio to it (``ceiling_ratio``), with
    the data-wait fraction; ``workers_alone_batches_per_s`` checks the workers' own rate (no step).
    ``step_p50_ms`` / ``step_p90_ms`` / ``step_p99_ms``: the step's own time after ``next()`` returned (against
    ``ceiling_step_p50_ms``), so a step slowed beside the loader shows as a shift or as a tail.
    On CUDA, events on the training stream split each step's period on the GPU: ``gpu_busy_*_ms``
    (the step's kernels, slowed by what runs beside them: the loader's copies) and
    ``gpu_turnaround_*_ms`` (the GPU idle from one step's end to the next one's start: the host's wake
    from the step's sync, ``next()``, the launch; torch's ``.to()`` copy lands here too), against the
    ceiling's (``ceiling_gpu_*``).

    python bench/prefetch.py --device cuda          # the H200 run, writes bench/results/prefetch.json
    python bench/prefetch.py --quick                # CPU smoke check
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from bench.common import replay, sync, table, write_result  # noqa: E402
from datapipe.units import percentiles  # noqa: E402
from datapipe import DevicePrefetcher  # noqa: E402
from loaders import DataLoader  # noqa: E402

MB = 1 << 20


# ---------------------------------------------------------------- (a) bandwidth --------------------

def bandwidth(device: torch.device, size_mb: int, iters: int) -> list[dict]:
    n = size_mb * MB
    pageable = torch.randint(0, 255, (n,), dtype=torch.uint8)
    rows = []

    def record(method, seconds):
        rows.append({"size_mb": size_mb, "method": method, "iters": iters,
                     "gb_per_s": round(n * iters / seconds / 1e9, 2)})

    def timed(fn):
        fn()  # warm-up (allocations, pool)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    if device.type == "cuda":
        pinned = pageable.pin_memory()
        dst = torch.empty(n, dtype=torch.uint8, device=device)

        def plain(src, non_blocking):
            def run():
                for _ in range(iters):
                    dst.copy_(src, non_blocking=non_blocking)
            return run

        def as_to(src):
            def run():
                for _ in range(iters):
                    src.to(device, non_blocking=True)
            return run

        record("pageable .to()", timed(plain(pageable, False)))
        record("pinned ceiling", timed(as_to(pinned)))
    else:
        record("clone (cpu)", timed(lambda: [pageable.clone() for _ in range(iters)]))

    def prefetch(src):
        pf = DevicePrefetcher([src] * iters, device=device, depth=2)

        def run():
            for _ in pf:
                pass
        return run, pf

    run, pf = prefetch(pageable)
    record("DevicePrefetcher (pageable src)", timed(run))
    pool = pf.pool_stats()
    pf.close()
    rows[-1]["pool_buffers"] = pool["buffers"]
    if device.type == "cuda":
        run, pf = prefetch(pinned)
        record("DevicePrefetcher (pinned src)", timed(run))
        pf.close()
    ceiling = next((r["gb_per_s"] for r in rows if r["method"] == "pinned ceiling"), None)
    for r in rows:
        r["vs_pinned"] = round(r["gb_per_s"] / ceiling, 3) if ceiling else None
    return rows


# ---------------------------------------------------------------- (b) training loop ----------------

class CostlyImages(Dataset):
    """uint8 images (copies of a random pool made once); each sample burns ``sample_cost_s`` of CPU,
    so a batch's CPU cost in a worker is what the case says, plus the copy and the collate."""

    def __init__(self, n: int, shape: tuple, sample_cost_s: float):
        self.n, self.cost = n, sample_cost_s
        self.pool = torch.randint(0, 255, (16, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        end = time.perf_counter() + self.cost
        x = self.pool[i % len(self.pool)].clone()
        while time.perf_counter() < end:
            pass
        return x, i % 1000


class Step:
    """A GPU step of known duration: a chain of matmuls (bf16 on CUDA) that also reads the batch."""

    def __init__(self, device: torch.device, target_s: float, dim: int):
        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.w = (torch.randn(dim, dim, device=device) / dim ** 0.5).to(dtype)
        self.k = 1
        t = self._time(3)
        self.k = max(1, round(target_s / max(t, 1e-6)))
        self.seconds = self._time(3)

    def _time(self, reps):
        self(torch.zeros(1, device=self.device))
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            self(torch.zeros(1, device=self.device))
        sync(self.device)
        return (time.perf_counter() - t0) / reps

    def __call__(self, batch, done: "torch.cuda.Event | None" = None):
        x = self.w
        for _ in range(self.k):
            x = x @ self.w
        loss = x.float().mean() + batch.float().mean() * 0
        if done is not None:  # the step's GPU work ends here (bench timeline)
            done.record()
        return loss.item()  # a host sync, as logging the loss does


def train(loader_iter, step: Step, device: torch.device, steps: int, warmup: int, move: bool) -> dict:
    """Timed steps after ``warmup``: rate, data-wait fraction, and the step's own time (after ``next()``) per
    step in ms, so a slower step shows as a shift (every step) or a tail (some steps).

    On CUDA each timed step also records two events on the training stream, one when ``next()`` has
    returned and one after the step's last kernel (before its host sync), splitting the step's period
    on the GPU into ``gpu_busy_*_ms`` (from the first event to the second: the step's kernels, slowed
    by whatever else runs beside them) and ``gpu_turnaround_*_ms`` (from one step's end on the GPU to the
    next step's start: the host's wake from the sync, ``next()`` and the launch)."""
    wait = 0.0
    it = iter(loader_iter)
    t_start = None
    step_s = []
    cuda = device.type == "cuda"
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(steps)] if cuda else []
    for i in range(warmup + steps):
        if i == warmup:
            t_start, wait, step_s = time.perf_counter(), 0.0, []
        t0 = time.perf_counter()
        x, _ = next(it)
        if move:
            x = x.to(device, non_blocking=True)
        t1 = time.perf_counter()
        wait += t1 - t0
        if cuda and i >= warmup:
            begin, end = marks[i - warmup]
            begin.record()
            step(x, end)
        else:
            step(x)
        step_s.append(time.perf_counter() - t1)
    wall = time.perf_counter() - t_start
    spread = percentiles(step_s, qs=(50, 90, 99), scale=1e3, digits=3)
    out = {"steps_per_s": round(steps / wall, 2), "wait_fraction": round(wait / wall, 3), "wall_s": round(wall, 3),
           **{f"step_{k}_ms": v for k, v in spread.items()}}
    if cuda:
        out.update(gpu_timeline(marks))
    return out


def gpu_timeline(marks: list) -> dict:
    """Per-step GPU busy and turnaround times (ms) from (begin, end) event pairs: mean, p50, p90."""
    torch.cuda.synchronize()
    spans = {"gpu_busy": [b.elapsed_time(e) for b, e in marks],
             "gpu_turnaround": [marks[i][1].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]}
    return {f"{name}_{k}_ms": v for name, values in spans.items()
            for k, v in percentiles(values, qs=(50, 90), mean=True, digits=3).items()}


TIMELINE = ("gpu_busy_mean_ms", "gpu_turnaround_mean_ms", "gpu_busy_p50_ms", "gpu_turnaround_p50_ms")


def alone(loader, batches: int, warmup: int) -> float:
    """Batches per second the loader delivers with no training step: can its workers keep up at all?"""
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches / (time.perf_counter() - t0)
    del it
    return round(rate, 2)


def training(device: torch.device, *, workers: int, batch: int, shape: tuple, step_s: float, dim: int,
             steps: int, warmup: int, repeats: int = 1) -> list[dict]:
    """Per case and round: the ceiling (the same loop fed one cached device batch), torch's
    DataLoader(pin_memory) + ``.to()``, ours with ``device=`` and ours in torch's idiom
    (``pin_memory=True`` + ``.to()``), in turn; each loader's rate as a ratio to the ceilings
    measured right before and after its round. Per case, the workers' rate with no step at all."""
    step = Step(device, step_s, dim)
    rows = []
    n = (steps + warmup + 2) * batch
    device_batch = (torch.zeros(batch, *shape, dtype=torch.uint8, device=device), None)
    for case, factor in (("host keeps up", 0.5), ("host cannot keep up", 2.0)):
        batch_cost = factor * workers * step.seconds  # CPU seconds per batch
        ds = CostlyImages(n, shape, batch_cost / batch)
        common = dict(batch_size=batch, num_workers=workers, shuffle=True)
        extra = {"persistent_workers": False, "prefetch_factor": 2} if workers else {}
        ideal = min(1 / step.seconds, workers / batch_cost if workers else 1 / (batch_cost + step.seconds))
        worker_rate = alone(torch.utils.data.DataLoader(ds, **common, **extra), batches=max(10, steps // 2),
                            warmup=max(2, workers))
        ceiling_runs = [train(replay(device_batch), step, device, steps, warmup, move=False)]
        for repeat in range(repeats):
            round_rows = []
            torch_loader = torch.utils.data.DataLoader(
                ds, pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(0), **common, **extra)
            r = train(torch_loader, step, device, steps, warmup, move=True)
            round_rows.append({"case": case, "loader": "torch DataLoader(pin_memory)", **r})
            for drop_in in (False, True):  # ours with device=, then torch's idiom with ours
                where = dict(pin_memory=device.type == "cuda") if drop_in else dict(device=device)
                ours = DataLoader(ds, **where, **common, **extra)
                r = train(ours, step, device, steps, warmup, move=drop_in)
                ours.close()
                name = "loaders.DataLoader(pin_memory) + .to()" if drop_in else "loaders.DataLoader(device)"
                round_rows.append({"case": case, "loader": name, **r})
            ceiling_runs.append(train(replay(device_batch), step, device, steps, warmup, move=False))
            before, after = ceiling_runs[-2], ceiling_runs[-1]
            ceiling = (before["steps_per_s"] + after["steps_per_s"]) / 2
            for row in round_rows:
                row.update(step_ms=round(step.seconds * 1e3, 2), batch_cpu_ms=round(batch_cost * 1e3, 1),
                           workers=workers, ideal_steps_per_s=round(ideal, 2), repeat=repeat,
                           ceiling_steps_per_s=round(ceiling, 2),
                           ceiling_step_p50_ms=round((before["step_p50_ms"] + after["step_p50_ms"]) / 2, 3),
                           **{f"ceiling_{k}": round((before[k] + after[k]) / 2, 3) for k in TIMELINE if k in before},
                           ceiling_ratio=round(row["steps_per_s"] / ceiling, 4),
                           of_ideal=round(row["steps_per_s"] / min(ideal, ceiling), 4),
                           workers_alone_batches_per_s=worker_rate,
                           samples_per_s=round(row["steps_per_s"] * batch, 1))
            rows += round_rows
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--iters", type=int, default=20, help="copies per bandwidth measurement")
    ap.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", type=int, nargs=3, default=[3, 224, 224])
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--dim", type=int, default=8192, help="matmul size of the GPU step")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first: the workers fill the pipeline")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each loader per case, in turn")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU smoke check")
    ap.add_argument("--out", default=None, help="directory for prefetch.json (default bench/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes_mb, args.iters, args.batch, args.image = [4, 8], 3, 8, [3, 32, 32]
        args.steps, args.warmup, args.dim, args.step_ms = 12, 2, 256, 5.0
        args.workers = min(args.workers, 1)
    device = torch.device(args.device)
    bw = [r for size in args.sizes_mb for r in bandwidth(device, size, args.iters)]
    tr = training(device, workers=args.workers, batch=args.batch, shape=tuple(args.image),
                  step_s=args.step_ms / 1e3, dim=args.dim, steps=args.steps, warmup=args.warmup,
                  repeats=args.repeats)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "cpu_count": os.cpu_count(), "args": vars(args), "bandwidth": bw, "training": tr,
              "target": "DevicePrefetcher >= 0.85 x pinned ceiling"}
    path = write_result("prefetch", result, args.out)
    print(table(bw, ["size_mb", "method", "gb_per_s", "vs_pinned"]))
    print()
    print(table(tr, ["case", "loader", "repeat", "batch_cpu_ms", "workers_alone_batches_per_s", "steps_per_s",
                     "ceiling_steps_per_s", "ceiling_ratio", "of_ideal", "wait_fraction", "step_p50_ms",
                     "step_p90_ms", "ceiling_step_p50_ms", "gpu_busy_mean_ms", "ceiling_gpu_busy_mean_ms",
                     "gpu_turnaround_mean_ms", "ceiling_gpu_turnaround_mean_ms", "gpu_turnaround_p90_ms"]))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
