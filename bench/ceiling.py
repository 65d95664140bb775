"""Training at its data-free ceiling: each loader's rate over the same training step fed one cached batch.

One process, one GPU. Loaders (``--loaders``):

- ``imageloader``: ``loaders.ImageLoader`` with its defaults;
- ``imageloader_cuda`` (not run unless named): ImageLoader on nvJPEG's CUDA decoder throughout
  (``DecodeOptions(hw_decoder_load=0.0)``: no move to the hardware decoder, the setting advised under CUDA graphs);
- ``dali``: the DALI loop a user writes by hand (``readers.webdataset`` + ``decoders.image_random_crop``
  mixed + ``resize`` + ``crop_mirror_normalize``, ``pipe.run()`` in the training thread, outputs copied on
  its stream: ``datapipe.tools.bench.baselines.DaliBaseline``);
- ``dataloader``: ``loaders.DataLoader(device=...)`` over a map-style uint8 224x224 dataset that keeps up,
  ``--epoch-batches`` long (64: every row's timed steps cross one epoch start, which costs ~45 ms of the
  workers' first batch, torch's ~117 ms; 5004, ImageNet-1k's train split at batch 256, crosses none);
- ``torch_dataloader``: torch's DataLoader over the same dataset, ``pin_memory=True`` +
  ``.to(device, non_blocking=True)`` (the usual idiom);
- ``tokenloader``: ``loaders.TokenLoader`` (4 x 4096 packed rows) into a ~162M-parameter Llama.

The image step is ResNet-50 (random init, bf16 autocast, channels_last, SGD, batch 256); uint8
batches are normalised in it. Each loader runs in both loop styles (``--loops``):
``runs_ahead`` waits for the GPU only every 50 steps (a loop that logs every 50; the host queues
work ahead and the GPU never idles: the headline) and ``waits_each_step`` synchronises after every
step. A row is one loader in one loop style: a fresh loader, ``--warmup`` untimed steps, then
``--steps`` timed ones; its ceiling is the same loop replaying one cached device batch of the same
format, measured right before and right after it (``ceiling_ratio`` = rate / their mean);
``wait_fraction`` is the share of wall time the loop spent in ``next()``. Rounds interleave:
every loader and loop style once per round, the order reversed every other round.

``--profile``: one ``runs_ahead`` window under the torch profiler for the ceiling, ImageLoader and
the hand DALI loop: per CUDA stream the kernels and copies, the loader's own work (streams other
than the training one), and how much longer the training stream's kernels ran than in the ceiling.
``--compile [MODE]``: the image loaders again, ResNet-50 under ``torch.compile`` (``MODE``, default
``default``; ``reduce-overhead`` for CUDA graphs; the max-autotune modes autotune for minutes), runs_ahead;
such rows say ``step: "compiled"`` and their ``compile_mode`` (``--rounds 0``: only those).

    python bench/ceiling.py                      # the H200 run: bench/results/ceiling.json
    python bench/ceiling.py --loaders imageloader,dali --rounds 1 --profile
    python bench/ceiling.py --loaders imageloader,imageloader_cuda,dali --rounds 0 --compile reduce-overhead \
        --steps 200 --out /tmp/c          # CUDA graphs: the default's move and trial against the CUDA decoder
    python bench/ceiling.py --quick --device cpu --out /tmp/x   # smoke check of the harness (tiny sizes)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import analyse, sync, table, write_result  # noqa: E402
from bench.ceiling_record import appended, decoder_choice, earlier_record, next_round, summary  # noqa: E402,F401
from bench.models import ImageStep, LlamaStep  # noqa: E402
from datapipe.tools.bench.baselines import DaliBaseline, close, endless, replay  # noqa: E402

CONNECTIONS = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")  # recorded per row: it decides DALI's queues (docs)
LOOPS = {"runs_ahead": 50, "waits_each_step": 1}  # loop style -> wait for the GPU every this many steps
LOADER_NAMES = ("imageloader", "dali", "dataloader", "torch_dataloader", "tokenloader", "imageloader_cuda")
DEFAULT_LOADERS = LOADER_NAMES[:5]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FORMAT = {"imageloader": "images", "imageloader_cuda": "images", "dali": "images", "dataloader": "uint8",
          "torch_dataloader": "uint8", "tokenloader": "tokens"}  # rows of one format share a step and its cached batch


# ---- the loop -------------------------------------------------------------------------------------------
def run_loop(batches, step, *, steps: int, warmup: int, every: int, device: torch.device, count) -> dict:
    """``warmup`` untimed steps, then ``steps`` timed ones, waiting for the GPU every ``every`` steps and at the end.

    The time in ``next()`` is the data wait; the loop itself never touches the loader's streams.
    """
    it = iter(batches)
    for _ in range(warmup):
        step(next(it))
    sync(device)
    wait = 0.0
    units = 0
    start = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        wait += time.perf_counter() - t0
        step(batch)
        units += count(batch)
        if device.type == "cuda" and (i + 1) % every == 0:
            torch.cuda.current_stream(device).synchronize()
    sync(device)
    wall = time.perf_counter() - start
    return {"rate": units / wall, "wait_fraction": wait / wall, "step_ms": 1e3 * wall / steps}


def _clone(batch):
    if isinstance(batch, dict):
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    return tuple(v.clone() for v in batch)


# ---- the loaders ------------------------------------------------------------------------------------------
class Uint8Images(torch.utils.data.Dataset):
    """Map-style uint8 3x224x224 images (copies from a random pool) and int labels: cheap, so workers keep up."""

    def __init__(self, n: int, size: int):
        self.n = n
        self.pool = torch.randint(0, 255, (64, 3, size, size), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.pool[i % 64].clone(), i % 1000


def torch_idiom(loader, device):
    """torch's usual device feed: ``pin_memory=True`` batches moved with ``.to(device, non_blocking=True)``,
    epoch after epoch (a plain ``for`` over the loader: its persistent workers serve every epoch)."""
    while True:
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def make_feed(name: str, args, data: dict):
    """(batches, closer) of loader ``name``: a fresh loader, epoch after epoch."""
    dev = args.device
    if name in ("imageloader", "imageloader_cuda"):
        from loaders import DecodeOptions, ImageLoader

        decode = DecodeOptions(hw_decoder_load=0.0) if name == "imageloader_cuda" else None
        loader = ImageLoader(data["images"], batch_size=args.batch_size, image_size=args.image_size, device=dev,
                             decode=decode)
        return endless(loader), loader
    if name == "dali":
        dali = DaliBaseline(data["images"], batch_size=args.batch_size, image_size=args.image_size,
                            device=dev.type, threads=min(8, os.cpu_count() or 1))
        return iter(dali), None
    if name in ("dataloader", "torch_dataloader"):
        ds = Uint8Images(args.batch_size * args.epoch_batches, args.image_size)
        common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True,
                      persistent_workers=True)
        if name == "dataloader":
            from loaders import DataLoader

            loader = DataLoader(ds, device=dev, **common)
            return endless(loader), loader
        loader = torch.utils.data.DataLoader(ds, pin_memory=dev.type == "cuda", **common)
        return torch_idiom(loader, dev), loader
    if name == "tokenloader":
        from loaders import TokenLoader

        loader = TokenLoader(data["tokens"], seq_len=args.seq_len, batch_size=args.token_batch, device=dev)
        return endless(loader), None
    raise ValueError(f"unknown loader {name!r}: use one of {', '.join(LOADER_NAMES)}")


def close_feed(feed, owner) -> None:
    """Stop a feed and its loader's worker processes, and wait until they are gone."""
    if feed is not None:
        close(feed)
    if owner is not None:
        close(getattr(owner, "_iterator", None))  # torch's persistent workers
    gc.collect()
    import multiprocessing

    deadline = time.perf_counter() + 30
    while multiprocessing.active_children() and time.perf_counter() < deadline:
        time.sleep(0.05)


# ---- rows --------------------------------------------------------------------------------------------------
class Bench:
    """The steps, cached batches and last ceilings per (format, loop); runs rows and ceilings."""

    def __init__(self, args, data: dict):
        self.args, self.data = args, data
        self.steps: dict = {}
        self.cached: dict = {}
        self.last: dict = {}  # (format, loop) -> the latest ceiling rate
        self.rows: list[dict] = []

    def step(self, fmt: str, compiled: bool = False):
        key = (fmt, compiled)  # one compile mode per run: args.compile
        if key not in self.steps:
            a = self.args
            if fmt == "tokens":
                self.steps[key] = LlamaStep(a.device, a.seq_len, small=a.quick)
            else:
                self.steps[key] = ImageStep(a.device, a.arch, compile=a.compile if compiled else False)
        return self.steps[key]

    @staticmethod
    def count(fmt: str):
        if fmt == "tokens":
            return lambda b: int(b["input_ids"].numel())
        return lambda b: int(b[0].shape[0])

    def ceiling(self, fmt: str, loop: str, compiled: bool = False) -> float:
        a = self.args
        first = (fmt, loop, compiled) not in self.last
        r = run_loop(replay(self.cached[fmt]), self.step(fmt, compiled), steps=a.ceiling_steps,
                     warmup=a.warmup if first else 5, every=LOOPS[loop], device=a.device, count=self.count(fmt))
        self.last[(fmt, loop, compiled)] = r["rate"]
        return r["rate"]

    def row(self, name: str, loop: str, round_: int, compiled: bool = False) -> dict:
        a = self.args
        fmt = FORMAT[name]
        print(f"[{name} {loop}{' compiled' if compiled else ''} round {round_}]", file=sys.stderr, flush=True)
        feed = owner = None
        try:
            feed, owner = make_feed(name, a, self.data)
            if fmt not in self.cached:
                first = next(feed)
                self.cached[fmt] = _clone(first)
            before = self.last.get((fmt, loop, compiled)) or self.ceiling(fmt, loop, compiled)
            r = run_loop(feed, self.step(fmt, compiled), steps=a.steps, warmup=a.warmup, every=LOOPS[loop],
                         device=a.device, count=self.count(fmt))
            chosen = decoder_choice(owner)
        except Exception as e:  # one broken loader must not cost the other rows
            traceback.print_exc()
            out = {"loader": name, "loop": loop, "round": round_, "step": "compiled" if compiled else "eager",
                   "error": repr(e)[:300]}
            self.rows.append(out)
            return out
        finally:
            close_feed(feed, owner)
        after = self.ceiling(fmt, loop, compiled)
        ceiling = (before + after) / 2
        out = {"loader": name, "loop": loop, "round": round_, "step": "compiled" if compiled else "eager",
               **({"compile_mode": a.compile} if compiled else {}),
               "cuda_device_max_connections": CONNECTIONS,
               "rate": round(r["rate"], 1), "ceiling": round(ceiling, 1), "ceiling_before": round(before, 1),
               "ceiling_after": round(after, 1), "ceiling_ratio": round(r["rate"] / ceiling, 4),
               "wait_fraction": round(r["wait_fraction"], 4), "step_ms": round(r["step_ms"], 2),
               "unit": "tokens/s" if fmt == "tokens" else "images/s", **chosen}
        print(f"    {out}", file=sys.stderr, flush=True)
        self.rows.append(out)
        return out


# ---- the profile -------------------------------------------------------------------------------------------
def _trace_events(prof, path: str) -> list[dict]:
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def profile_window(batches, step, args, steps: int, trace_dir: str, name: str) -> list[dict]:
    """The device events of ``steps`` runs_ahead steps (after a warm-up), from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    it = iter(batches)
    for _ in range(args.warmup):
        step(next(it))
    sync(args.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(next(it))
        sync(args.device)
    return _trace_events(prof, os.path.join(trace_dir, f"trace_{name}.json"))


def profile_part(bench: Bench, args, trace_dir: str) -> dict:
    """ImageLoader and the hand loop beside the ceiling, one runs_ahead window each, under the profiler."""
    steps = 10
    step = bench.step("images")
    base = profile_window(replay(bench.cached["images"]), step, args, steps, trace_dir, "ceiling")
    kernel_streams: dict = {}
    for e in base:
        s = e.get("args", {}).get("stream")
        kernel_streams[s] = kernel_streams.get(s, 0) + e["dur"]
    train_stream = max(kernel_streams, key=kernel_streams.get)
    out = {"steps": steps, "ceiling": analyse(base, steps, train_stream)}
    for name in ("imageloader", "dali"):
        feed = owner = None
        try:
            feed, owner = make_feed(name, args, bench.data)
            out[name] = analyse(profile_window(feed, step, args, steps, trace_dir, name), steps, train_stream)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[name] = {"error": repr(e)[:300]}
        finally:
            close_feed(feed, owner)
        c, r = out["ceiling"]["train_kernel_ms_per_step"], out[name].get("train_kernel_ms_per_step")
        if r:
            out[name]["train_kernel_stretch"] = round(r / c, 4)
        print(f"[profile {name}] {out[name]}", file=sys.stderr, flush=True)
    return out


# ---- main --------------------------------------------------------------------------------------------------
def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchvision", "nvidia-dali-cuda130", "transformers", "webdataset"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def prepare_data(args) -> dict:
    from bench.images import ensure_dataset

    data = {}
    if any(FORMAT[name] == "images" for name in args.loaders):
        per_shard = 16 if args.quick else 256
        data["images"], _ = ensure_dataset(args.data, args.num_images, workers=os.cpu_count() or 1,
                                           per_shard=per_shard)
    if "tokenloader" in args.loaders:
        from bench.common import ensure_tokens

        data["tokens"] = ensure_tokens(args.tokens_dir, args.docs, 0)
    return data


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the training step runs (default: cuda when there is one)")
    p.add_argument("--loaders", default=",".join(DEFAULT_LOADERS),
                   help="comma list of " + ", ".join(LOADER_NAMES) + " (default: all but imageloader_cuda)")
    p.add_argument("--loops", default=",".join(LOOPS), help="comma list of " + ", ".join(LOOPS))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a row per loader and loop each)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per row (a multiple of 50 for runs_ahead)")
    p.add_argument("--ceiling-steps", type=int, default=100, help="timed steps of each ceiling measurement")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each row")
    p.add_argument("--data", default="/tmp/datapipe-bench-images", help="image shards (made there if missing)")
    p.add_argument("--num-images", type=int, default=20000, help="JPEGs to make when --data is empty")
    p.add_argument("--tokens-dir", default="/tmp/datapipe-scaling-tokens", help="token shards (made if missing)")
    p.add_argument("--docs", type=int, default=20000, help="documents to make when --tokens-dir is empty")
    p.add_argument("--batch-size", type=int, default=256, help="images per batch")
    p.add_argument("--image-size", type=int, default=224, help="crop size of the images")
    p.add_argument("--arch", default="resnet50", help="torchvision model of the image step (a tiny CNN without "
                                                       "torchvision)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row (TokenLoader)")
    p.add_argument("--token-batch", type=int, default=4, help="packed rows per batch (TokenLoader)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers of the dataloader rows")
    p.add_argument("--epoch-batches", type=int, default=64,
                   help="batches per epoch of the dataloader rows (64: a row crosses one epoch start; 5004: "
                        "ImageNet-1k's train split at batch 256, none)")
    p.add_argument("--profile", action="store_true", help="profile one runs_ahead window (ImageLoader, hand loop)")
    p.add_argument("--trace-dir", default=None, help="where the profiler's traces go (default: a temporary folder)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES, metavar="MODE",
                   help="also rows with the image step under torch.compile in MODE: " + ", ".join(COMPILE_MODES)
                        + " (default 'default'; 'reduce-overhead' uses CUDA graphs; the max-autotune modes "
                          "autotune for minutes on ResNet-50)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new round after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="smoke check of the harness: tiny data (its own folders, -quick* beside --data and "
                        "--tokens-dir), resnet18, a few steps; its ratios measure nothing")
    p.add_argument("--out", default=None, help="results directory (default bench/results: a full run replaces "
                                               "ceiling.json there unless --append)")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to the ceiling.json already in --out, numbering its rounds on and "
                        "keeping the file's other keys (the same GPU only)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_images, args.batch_size, args.image_size, args.arch = 64, 4, 32, "resnet18"
        args.steps, args.ceiling_steps, args.warmup, args.rounds = 2, 2, 1, min(args.rounds, 1)
        args.data = args.data.rstrip("/") + f"-quick{args.num_images}"  # its own folder per size
        args.tokens_dir, args.docs, args.seq_len, args.token_batch, args.workers = args.tokens_dir + "-quick", 200, 128, 2, 1
        args.epoch_batches = 2  # epochs end within a row
    args.device = torch.device(args.device)
    args.loaders = [x for x in args.loaders.split(",") if x]
    args.loops = [x for x in args.loops.split(",") if x]
    for name in args.loaders:
        if name not in LOADER_NAMES:
            p.error(f"unknown loader {name!r}: use {', '.join(LOADER_NAMES)}")
    for loop in args.loops:
        if loop not in LOOPS:
            p.error(f"unknown loop {loop!r}: use {', '.join(LOOPS)}")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.quick:
        print("--quick: a smoke check of the harness at tiny sizes; its ratios mean nothing", file=sys.stderr)
    t0 = time.perf_counter()
    if args.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    data = prepare_data(args)
    bench = Bench(args, data)
    out = {"gpu": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
           "cpu_count": os.cpu_count(), "versions": versions(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "config": {k: str(v) for k, v in vars(args).items()}, "loops": LOOPS, "rows": bench.rows}
    earlier = earlier_record(args) if args.append else {}
    if earlier:
        out = appended(earlier, out)
    first = next_round(bench.rows, "eager")
    order = [(name, loop) for loop in args.loops for name in args.loaders]
    for r in range(first, first + args.rounds):
        if r > first and time.perf_counter() - t0 > args.budget_s:
            break
        for name, loop in (order if r % 2 == 0 else order[::-1]):
            bench.row(name, loop, r)
        out["summary"] = summary(bench.rows)
        write_result("ceiling", out, args.out)
    if args.compile:
        first = next_round(bench.rows, "compiled")
        for r in range(first, first + max(1, min(2, args.rounds))):
            for name in args.loaders:
                if FORMAT[name] == "images":
                    bench.row(name, "runs_ahead", r, compiled=True)
    if args.profile and args.device.type == "cuda" and "images" in bench.cached:
        import tempfile

        out["profile"] = profile_part(bench, args, args.trace_dir or tempfile.mkdtemp(prefix="ceiling-trace-"))
    out["summary"] = summary(bench.rows)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    path = write_result("ceiling", out, args.out)
    cols = ["loader", "loop", "step", "connections", "rows", "ceiling_ratio", "min", "max", "wait_fraction", "rate"]
    print(table(out["summary"], cols))
    print(f"wrote {path} ({out['seconds']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
