"""Worker batches in recycled shared memory (``loaders.dataloader.shm``, ``loaders.dataloader.rawshm``) against torch.

Two modes (``--mode``, default both, one JSON). ``raw``: raw samples as a ``ShardStream`` yields them
(``__key__``, ``__url__``, a ``jpg`` of up to ``--raw-bytes`` (~107 KB, sizes varying) and a ``cls``,
made by the workers as fast as they can), batches of ``--raw-batch-size`` (256) with a list-returning
collate (``list``), ``default_collate`` (``default``: a dict of lists) or a list of samples whose ``jpg`` is a
uint8 tensor of its own (``tensors``: decoded images of varying sizes), no device; samples per second
(median of the rounds, variants interleaved) of ``torch`` (torch's DataLoader: every batch pickled
through a pipe) and ``ours`` (``loaders.DataLoader``: the raw leaves in recycled shared memory, copied
out in the main process), and the main process's CPU time per sample (``main_cpu_us_per_sample``: its
share of the work, which caps the rate once the workers are many). The consumer reads every sample's length.

``images``: worker-bound loading: the workers make batches of ``--batch-size`` 3x224x224 uint8 images (a copy of
one image per sample, plus ``--spin-ms`` of CPU work per batch for each case) and the main process
takes them as fast as they come. Per case and variant, batches per second (median of the rounds,
variants interleaved in each round):

- ``torch``: torch's DataLoader (``default_collate`` stacks into new shared memory); the main process
  copies each batch out (the pinning stand-in) and drops it;
- ``recycled``: the same with ``PooledCollate``, each batch's segments given back after the copy;
- on CUDA, the loaders as users run them: ``dl_torch`` torch's ``pin_memory=True`` + ``.to(non_blocking)``,
  ``dl_ours`` ``loaders.DataLoader(device="cuda")``, ``dl_ours_pin_memory`` ``loaders.DataLoader(pin_memory=True)`` + ``.to(non_blocking)`` (torch's idiom).

    python bench/worker_shm.py                      # CPU: bench/results/worker_shm.json
    python bench/worker_shm.py --mode raw --workers 8   # the raw-samples rows alone, 8 workers
    python bench/worker_shm.py --device cuda        # the H200 run, all variants
    python bench/worker_shm.py --quick              # smoke check (tiny)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader, Dataset, IterableDataset, default_collate  # noqa: E402
from torch.utils.data import get_worker_info  # noqa: E402

from bench.common import table, write_result  # noqa: E402
from loaders.dataloader.returns import SegmentReturns  # noqa: E402
from loaders.dataloader.shm import PooledCollate  # noqa: E402


class Frames(Dataset):
    """Sample i: a copy of one 3 x size x size uint8 image (its first byte set from i) and the label i."""

    def __init__(self, n: int, size: int):
        self.n = n
        self.image = torch.randint(0, 256, (3, size, size), dtype=torch.uint8)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        out = self.image.clone()
        out.view(-1)[0] = i % 256
        return out, i


class RawSamples(IterableDataset):
    """``n`` raw samples shaped like a ``ShardStream``'s, split over the workers: sample i's ``jpg`` holds
    ``size - i % 997`` bytes of a fixed random blob from offset ``i % size``, its ``cls`` is ``str(i % 10)``."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size
        self.blob = torch.randint(0, 256, (2 * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
                                  ).numpy().tobytes()

    def sample(self, i: int) -> dict:
        start = i % self.size
        return {"__key__": f"{i:08d}", "__url__": f"shards/shard-{i // 1000:06d}.tar",
                "jpg": self.blob[start:start + self.size - i % 997], "cls": str(i % 10).encode()}

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.n, workers):
            yield self.sample(i)


def as_list(samples):
    """A list-returning collate: the batch is the list of samples."""
    return list(samples)


def as_tensors(samples):
    """A list-returning collate of decoded samples: each ``jpg`` as a uint8 tensor of its own (a list of
    decoded images of varying sizes: the batch's tensors travel in one block and come out one storage each)."""
    return [{**s, "jpg": torch.frombuffer(bytearray(s["jpg"]), dtype=torch.uint8)} for s in samples]


def read_lengths(batch) -> int:
    """The consumer: every sample's ``jpg`` length (a list of sample dicts, or default_collate's dict of lists)."""
    if isinstance(batch, dict):
        return sum(len(b) for b in batch["jpg"])
    return sum(len(s["jpg"]) for s in batch)


def raw_variants(args, collate, cpu: dict) -> dict:
    """name -> function running one raw-samples measurement (batches per second); ``cpu[name]`` gets the main
    process's CPU seconds per batch of each run."""
    from loaders import DataLoader

    n = (args.batches + args.warmup + 2 * args.workers) * args.raw_batch_size
    common = dict(batch_size=args.raw_batch_size, num_workers=args.workers, prefetch_factor=args.prefetch_factor,
                  collate_fn=collate)

    def torch_run():
        return drain(TorchLoader(RawSamples(n, args.raw_bytes), **common), args.batches, args.warmup, read_lengths,
                     cpu=cpu.setdefault("torch", []))

    def ours():
        dl = DataLoader(RawSamples(n, args.raw_bytes), **common)
        rate = drain(dl, args.batches, args.warmup, read_lengths, cpu=cpu.setdefault("ours", []))
        dl.close()
        return rate

    return {"torch": torch_run, "ours": ours}


class Spin:
    """collate_fn: ``ms`` of busy CPU in the worker (a batch's decoding, say), then ``collate``."""

    def __init__(self, collate, ms: float):
        self.collate = collate
        self.ms = ms

    def __call__(self, samples):
        end = time.perf_counter() + self.ms / 1e3
        while time.perf_counter() < end:
            pass
        return self.collate(samples)


def drain(batches, limit: int, warmup: int, take, finish=None, cpu: list | None = None) -> float:
    """Batches per second over ``limit`` batches after ``warmup``, each passed to ``take``; ``finish()``
    (the device's queued copies) inside the timed window. ``cpu``: gets the main process's CPU seconds (all
    its threads, not the workers') per batch over the window appended."""
    it = iter(batches)
    for _ in range(warmup):
        take(next(it))
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(limit):
        take(next(it))
    if finish is not None:
        finish()
    rate = limit / (time.perf_counter() - t0)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / limit)
    close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if close is not None:
        close()
    return rate


def variants(args, spin_ms: float) -> dict:
    """name -> function running one measurement (batches per second)."""
    n = (args.batches + args.warmup) * args.batch_size
    common = dict(batch_size=args.batch_size, num_workers=args.workers, prefetch_factor=args.prefetch_factor)
    out_buf = torch.empty(args.batch_size, 3, args.size, args.size, dtype=torch.uint8)

    def copy_out(batch):
        images, labels = batch
        out_buf[: len(images)].copy_(images)
        return labels.sum()

    def torch_run():
        dl = TorchLoader(Frames(n, args.size), collate_fn=Spin(default_collate, spin_ms), **common)
        return drain(dl, args.batches, args.warmup, copy_out)

    def recycled_run():
        returns = SegmentReturns(os.urandom(8), workers=args.workers, batches=args.prefetch_factor + 2)
        collate = PooledCollate(Spin(default_collate, spin_ms), returns.mark, returns.batches)
        dl = TorchLoader(Frames(n, args.size), collate_fn=collate, **common)

        def take(batch):
            copy_out(batch)
            returns.release(batch)

        rate = drain(dl, args.batches, args.warmup, take)
        returns.clear()
        return rate

    runs = {"torch": torch_run, "recycled": recycled_run}
    if args.device == "cuda":
        from loaders import DataLoader

        device = torch.device("cuda")

        def to_gpu(batch):
            images, labels = batch
            return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

        def dl_torch():
            dl = TorchLoader(Frames(n, args.size), collate_fn=Spin(default_collate, spin_ms), pin_memory=True,
                             **common)
            return drain(dl, args.batches, args.warmup, to_gpu, torch.cuda.synchronize)

        def dl_ours():
            dl = DataLoader(Frames(n, args.size), collate_fn=Spin(default_collate, spin_ms), device="cuda",
                            **common)
            rate = drain(dl, args.batches, args.warmup, lambda b: None, torch.cuda.synchronize)
            dl.close()
            return rate

        def dl_ours_pin_memory():  # torch's idiom with our loader: pinned CPU batches, .to() by the loop
            dl = DataLoader(Frames(n, args.size), collate_fn=Spin(default_collate, spin_ms), pin_memory=True,
                            **common)
            rate = drain(dl, args.batches, args.warmup, to_gpu, torch.cuda.synchronize)
            dl.close()
            return rate

        runs.update(dl_torch=dl_torch, dl_ours=dl_ours, dl_ours_pin_memory=dl_ours_pin_memory)
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="images,raw", help="comma list of images, raw")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workers", type=int, default=None, help="default: 8 on CUDA, else min(4, cores)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--prefetch-factor", type=int, default=2)
    ap.add_argument("--batches", type=int, default=60, help="timed batches per measurement")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spin-ms", default="0,30", help="comma list: the cases' CPU work per batch in a worker")
    ap.add_argument("--raw-batch-size", type=int, default=256)
    ap.add_argument("--raw-bytes", type=int, default=107_000, help="raw mode: a sample's jpg size (at most)")
    ap.add_argument("--collates", default="list,default,tensors",
                    help="raw mode: comma list of list, default, tensors")
    ap.add_argument("--quick", action="store_true", help="smoke check: tiny images, few batches")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--plot", action="store_true", help="also draw the rates beside the JSON (worker_shm.png)")
    args = ap.parse_args(argv)
    if args.workers is None:
        args.workers = 8 if args.device == "cuda" else min(4, os.cpu_count() or 1)
    if args.quick:
        args.size, args.batch_size, args.batches, args.warmup, args.rounds, args.spin_ms = 32, 8, 6, 2, 1, "0"
        args.raw_batch_size, args.raw_bytes = 16, 20_000  # 16 x ~20 KB: still packed
    modes = [m for m in args.mode.split(",") if m]
    if set(modes) - {"images", "raw"}:
        raise ValueError(f"--mode {args.mode!r}: pass a comma list of images, raw")
    rows, raw = [], {}
    for spin in [float(s) for s in args.spin_ms.split(",") if s] if "images" in modes else []:
        rates = interleaved(variants(args, spin), args.rounds, label=f"spin {spin} ms", unit="batches/s", digits=2)
        rows += rows_vs_torch(rates, {"spin_ms": spin}, name="variant", value="batches_per_s", digits=2)
        raw[str(spin)] = rates
    raw_rows = raw_samples(args) if "raw" in modes else []
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = {"gpu": gpu, "cpu_count": os.cpu_count(), "config": vars(args), "rows": rows, "raw_rows": raw_rows}
    path = write_result("worker_shm", result, args.out)
    if rows:
        print(table(rows, ["spin_ms", "variant", "batches_per_s", "vs_torch", "rounds"]))
    if raw_rows:
        print(table(raw_rows, ["collate", "variant", "samples_per_s", "vs_torch", "main_cpu_us_per_sample", "rounds"]))
    print(f"wrote {path}")
    if args.plot:
        from datapipe.tools.plots import plot_worker_shm

        print(f"wrote {plot_worker_shm(result, os.path.splitext(path)[0] + '.png')}")
    return result


def raw_samples(args) -> list[dict]:
    """The raw-samples rows: per collate and variant, samples per second (median of the rounds) and vs torch."""
    collates = {"list": as_list, "default": default_collate, "tensors": as_tensors}
    rows = []
    for name in [c for c in args.collates.split(",") if c]:
        if name not in collates:
            raise ValueError(f"--collates {args.collates!r}: pass a comma list of list, default, tensors")
        cpu: dict = {}
        rates = interleaved(raw_variants(args, collates[name], cpu), args.rounds, label=f"raw {name}",
                            unit="samples/s", scale=args.raw_batch_size, digits=1)
        for row in rows_vs_torch(rates, {"collate": name}, name="variant", value="samples_per_s", digits=1):
            # the main process's CPU time per sample: its share of the work, whatever the machine's cores
            row["main_cpu_us_per_sample"] = round(statistics.median(cpu[row["variant"]]) / args.raw_batch_size * 1e6, 2)
            rows.append(row)
    return rows


def interleaved(runs: dict, rounds: int, *, label: str, unit: str, digits: int, scale: float = 1.0) -> dict:
    """Each variant's rate (batches/s from ``run()``, times ``scale``) per round, the variants interleaved."""
    rates = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items():
            rates[name].append(round(run() * scale, digits))
            print(f"{label}, round {r}, {name}: {rates[name][-1]} {unit}", file=sys.stderr, flush=True)
    return rates


def rows_vs_torch(rates: dict, fixed: dict, *, name: str, value: str, digits: int) -> list[dict]:
    """One row per variant: ``fixed``, the median rate and its ratio to torch's median, every round's rate."""
    base = statistics.median(rates["torch"])
    return [{**fixed, name: variant, value: round(statistics.median(v), digits),
             "vs_torch": round(statistics.median(v) / base, 3), "rounds": v} for variant, v in rates.items()]


if __name__ == "__main__":
    main()
