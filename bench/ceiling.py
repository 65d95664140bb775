"""Training at its data-free ceiling: each loader's rate over the same training step fed one cached batch.

One process, one GPU. Loaders (``--loaders``):

- ``imageloader``: ``loaders.ImageLoader`` with its defaults;
- ``imageloader_cuda`` (not run unless named): ImageLoader on nvJPEG's CUDA decoder throughout
  (``DecodeOptions(hw_decoder_load=0.0)``: no move to the hardware decoder, the setting advised under CUDA graphs);
- ``dali``: the DALI loop a user writes by hand (``readers.webdataset`` + ``decoders.image_random_crop``
  mixed + ``resize`` + ``crop_mirror_normalize``, ``pipe.run()`` in the training thread, outputs copied on
  its stream: ``datapipe.tools.bench.baselines.DaliBaseline``);
- ``dataloader``: ``loaders.DataLoader(device=...)`` over a map-style uint8 224x224 dataset that keeps up,
  ``--epoch-batches`` long (64: a row's 40 + 300 steps cross about five epoch starts, each ~45 ms of the
  workers' first batch, torch's ~117 ms: in the loop that waits each step ~1% of the row; 5004, ImageNet-1k's
  train split at batch 256, crosses none);
- ``torch_dataloader``: torch's DataLoader over the same dataset, ``pin_memory=True`` +
  ``.to(device, non_blocking=True)`` (the usual idiom);
- ``tokenloader``: ``loaders.TokenLoader`` (4 x 4096 packed rows) into a ~162M-parameter Llama;
- ``nvimg`` (a probe, not run unless named): the hardware JPEG decoder through nvImageCodec on a stream of its own
  (``bench/nvimg_feed.py``; options there).

Row sets (``--configs``, run in this order every round): ``eager`` (ResNet-50, random init, bf16 autocast,
channels_last, SGD, batch 256; uint8 batches normalised in the step; every loader, both loop styles),
``compiled`` (the same under ``torch.compile``, mode ``default``), ``cuda_graphs`` (mode ``reduce-overhead``)
and ``resnet18`` (eager ResNet-18, a model faster than the decoders): the last three for the image loaders
in runs_ahead. Loop styles: ``runs_ahead`` waits for the GPU only every 50 steps (a loop that logs every 50;
the host queues work ahead and the GPU never idles: the headline) and ``waits_each_step`` synchronises after
every step. A row is one loader in one loop style under one step: a fresh loader, ``--warmup`` untimed
steps (40), then ``--steps`` timed ones (300); its ceiling is the same loop replaying one cached device batch
of the same format, measured right before and right after it (``ceiling_ratio`` = rate / their mean); a
compile happens in the first ceiling's warm-up, never in a row. ``wait_fraction`` is the share of wall time
the loop spent in ``next()``. Rounds interleave: every row once per round, the order reversed every other
round. Each row says ``config``, ``loader``, ``loop``, ``step`` (eager / compiled), ``compile_mode``,
``arch`` and ``round``; the JSON is written after every row, so a run cut short keeps its rows.

``--profile``: one ``runs_ahead`` window under the torch profiler for the ceiling, ImageLoader and
the hand DALI loop, per row set of ``--profile-configs`` (default eager; with eager, TokenLoader against its
ceiling too): per CUDA stream the kernels and copies, the loader's own work (streams other than the training
one) and its copy time, how much longer the training stream's kernels ran than in the ceiling, and the host's
waits for the GPU (``...Synchronize`` calls per step).

A probe (``--rows config/loader[/loop],...``) runs the rows listed instead of the plan; a loader there or in
``--loaders`` may be ``imageloader@hw<share>+t<threads>+q<depth>+e<percent>+nohold``: ImageLoader with a fixed
hardware decoder share, DALI threads, batches made ahead, an earlier move (its default choice, moving after the
first judged batches at that starved share) and, with ``nohold``, no step hold.

    python bench/ceiling.py                      # the run of record: bench/results/ceiling.json
    python bench/ceiling.py --configs cuda_graphs,compiled,resnet18 --rounds 1 --out /tmp/c   # part of it
    python bench/ceiling.py --configs eager --rounds 1 --out /tmp/c --append                  # ... and the rest
    python bench/ceiling.py --loaders imageloader,dali --configs eager --rounds 1 --profile --out /tmp/c
    python bench/ceiling.py --quick --device cpu --out /tmp/x   # smoke check of the harness (tiny sizes)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import DEVICE_EVENTS, analyse, is_host_sync, sync, table, write_result  # noqa: E402
from bench.ceiling_record import appended, decoder_choice, earlier_record, merged, next_round, summary  # noqa: E402,F401
from bench.models import ImageStep, LlamaStep  # noqa: E402
from bench.ceiling_feeds import LOADER_NAMES, Uint8Images, close_feed, make_feed, torch_idiom, variant  # noqa: E402,F401
from datapipe.tools.bench.baselines import replay  # noqa: E402

CONNECTIONS = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")  # recorded per row: it decides DALI's queues (docs)
LOOPS = {"runs_ahead": 50, "waits_each_step": 1}  # loop style -> wait for the GPU every this many steps
DEFAULT_LOADERS = LOADER_NAMES[:5]
FORMAT = {"imageloader": "images", "imageloader_cuda": "images", "dali": "images", "dataloader": "uint8",
          "torch_dataloader": "uint8", "tokenloader": "tokens",
          "nvimg": "images"}  # rows of one format share a step and its cached batch


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


def _alloc_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def _memory(device: torch.device, retries_before: int) -> dict:
    """The caching allocator during a row: its retries (each frees cached blocks and waits for the GPU: a loop
    short of memory), what it holds and what the device has free as the row ends."""
    if device.type != "cuda":
        return {}
    free, _ = torch.cuda.mem_get_info(device)
    return {"alloc_retries": _alloc_retries(device) - retries_before,
            "reserved_gb": round(torch.cuda.memory_reserved(device) / 2**30, 1), "free_gb": round(free / 2**30, 1)}


def _clone(batch):
    if isinstance(batch, dict):
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    return tuple(v.clone() for v in batch)


# ---- rows --------------------------------------------------------------------------------------------------
# The main run's row sets: the step (arch, torch.compile mode), the formats (so the loaders) and loop styles.
CONFIGS = {
    "eager": {"arch": "resnet50", "compile": None, "formats": ("images", "uint8", "tokens"), "loops": tuple(LOOPS)},
    "compiled": {"arch": "resnet50", "compile": "default", "formats": ("images",), "loops": ("runs_ahead",)},
    "cuda_graphs": {"arch": "resnet50", "compile": "reduce-overhead", "formats": ("images",), "loops": ("runs_ahead",)},
    "resnet18": {"arch": "resnet18", "compile": None, "formats": ("images",), "loops": ("runs_ahead",)},
}


def fmt_of(loader: str) -> str:
    """The batch format of a loader name (a probe's ``imageloader@...`` is ImageLoader's)."""
    return FORMAT[variant(loader)[0]]


def plan(args) -> list[tuple[str, str, str]]:
    """One round's rows, ``(config, loader, loop)``, in the order asked (configs, then loops, then loaders)."""
    if args.rows:
        return list(args.rows)
    rows = []
    for name in args.configs:
        cfg = CONFIGS[name]
        rows += [(name, loader, loop) for loop in cfg["loops"] if loop in args.loops
                 for loader in args.loaders if fmt_of(loader) in cfg["formats"]]
    return rows


class Bench:
    """The steps, cached batches and last ceilings per (format, loop, step); runs rows and ceilings."""

    def __init__(self, args, data: dict):
        self.args, self.data = args, data
        self.steps: dict = {}
        self.cached: dict = {}
        self.last: dict = {}  # (format, loop, arch, compile) -> the latest ceiling rate
        self.rows: list[dict] = []

    def step(self, fmt: str, cfg: dict):
        a = self.args
        arch = a.arch or cfg["arch"]
        key = ("tokens",) if fmt == "tokens" else (fmt, arch, cfg["compile"])
        if key not in self.steps:
            if fmt == "tokens":
                self.steps[key] = LlamaStep(a.device, a.seq_len, small=a.quick)
            else:
                backend = "eager" if a.quick and cfg["compile"] else None  # --quick: dynamo without inductor
                self.steps[key] = ImageStep(a.device, arch, compile=cfg["compile"] or False, backend=backend)
        return self.steps[key]

    @staticmethod
    def count(fmt: str):
        if fmt == "tokens":
            return lambda b: int(b["input_ids"].numel())
        return lambda b: int(b[0].shape[0])

    def ceiling(self, fmt: str, loop: str, cfg: dict) -> float:
        a = self.args
        key = (fmt, loop, a.arch or cfg["arch"], cfg["compile"])
        first = key not in self.last
        r = run_loop(replay(self.cached[fmt]), self.step(fmt, cfg), steps=a.ceiling_steps,
                     warmup=a.warmup if first else 5, every=LOOPS[loop], device=a.device, count=self.count(fmt))
        self.last[key] = r["rate"]
        return r["rate"]

    def row(self, config: str, name: str, loop: str, round_: int) -> dict:
        a = self.args
        cfg = CONFIGS[config]
        fmt = fmt_of(name)
        compiled = bool(cfg["compile"])
        what = {"config": config, "loader": name, "loop": loop, "step": "compiled" if compiled else "eager",
                "compile_mode": cfg["compile"], "arch": "llama-162m" if fmt == "tokens" else a.arch or cfg["arch"],
                "round": round_}
        print(f"[{config}: {name} {loop} round {round_}]", file=sys.stderr, flush=True)
        started = time.perf_counter()  # the row's wall time, loader start and ceilings included (for planning runs)
        feed = owner = None
        try:
            feed, owner = make_feed(name, a, self.data)
            if fmt not in self.cached:
                self.cached[fmt] = _clone(next(feed))
            key = (fmt, loop, a.arch or cfg["arch"], cfg["compile"])
            before = self.last.get(key) or self.ceiling(fmt, loop, cfg)
            retries = _alloc_retries(a.device)
            r = run_loop(feed, self.step(fmt, cfg), steps=a.steps, warmup=a.warmup, every=LOOPS[loop],
                         device=a.device, count=self.count(fmt))
            chosen = {**decoder_choice(owner), **_memory(a.device, retries)}
        except Exception as e:  # one broken loader must not cost the other rows
            traceback.print_exc()
            out = {**what, "error": repr(e)[:300]}
            self.rows.append(out)
            return out
        finally:
            close_feed(feed, owner)
        after = self.ceiling(fmt, loop, cfg)
        ceiling = (before + after) / 2
        out = {**what, "cuda_device_max_connections": CONNECTIONS,
               "rate": round(r["rate"], 1), "ceiling": round(ceiling, 1), "ceiling_before": round(before, 1),
               "ceiling_after": round(after, 1), "ceiling_ratio": round(r["rate"] / ceiling, 4),
               "wait_fraction": round(r["wait_fraction"], 4), "step_ms": round(r["step_ms"], 2),
               "unit": "tokens/s" if fmt == "tokens" else "images/s", **chosen,
               "row_s": round(time.perf_counter() - started, 1)}
        print(f"    {out}", file=sys.stderr, flush=True)
        self.rows.append(out)
        return out


# ---- the profile -------------------------------------------------------------------------------------------
def _trace_events(prof, path: str) -> list[dict]:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # a --trace-dir not made yet
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if "dur" in e and (e.get("cat") in DEVICE_EVENTS or is_host_sync(e))]


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


def profile_part(bench: Bench, args, trace_dir: str, config: str = "eager", fmt: str = "images") -> dict:
    """The loaders of format ``fmt`` (images: ImageLoader and the hand loop, or the image loaders the run names
    with ``--loaders``/``--rows``; tokens: TokenLoader) beside the ceiling of row set ``config``, one runs_ahead
    window each, under the profiler."""
    steps = 10
    step = bench.step(fmt, CONFIGS[config])
    base = profile_window(replay(bench.cached[fmt]), step, args, steps, trace_dir, f"{config}_{fmt}_ceiling")
    kernel_streams: dict = {}
    for e in base:
        if e.get("cat") in DEVICE_EVENTS:
            s = e.get("args", {}).get("stream")
            kernel_streams[s] = kernel_streams.get(s, 0) + e["dur"]
    train_stream = max(kernel_streams, key=kernel_streams.get)
    out = {"config": config, "format": fmt, "steps": steps, "ceiling": analyse(base, steps, train_stream)}
    named = [n for n in getattr(args, "loaders", ()) if fmt_of(n) == fmt]
    for name in (named or (("imageloader", "dali") if fmt == "images" else ("tokenloader",))):
        feed = owner = None
        try:
            feed, owner = make_feed(name, args, bench.data)
            out[name] = analyse(profile_window(feed, step, args, steps, trace_dir, f"{config}_{name}"), steps,
                                train_stream)
            out[name].update(decoder_choice(owner))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[name] = {"error": repr(e)[:300]}
        finally:
            close_feed(feed, owner)
        c, r = out["ceiling"]["train_kernel_ms_per_step"], out[name].get("train_kernel_ms_per_step")
        if r:
            out[name]["train_kernel_stretch"] = round(r / c, 4)
        print(f"[profile {config} {name}] {out[name]}", file=sys.stderr, flush=True)
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
    if any(fmt_of(name) == "images" for name in args.loaders):
        per_shard = 16 if args.quick else 256
        data["images"], _ = ensure_dataset(args.data, args.num_images, workers=os.cpu_count() or 1,
                                           per_shard=per_shard)
    if any(fmt_of(name) == "tokens" for name in args.loaders):
        from bench.common import ensure_tokens

        data["tokens"] = ensure_tokens(args.tokens_dir, args.docs, 0)
    return data


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the training step runs (default: cuda when there is one)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma list of the row sets, run in this order each round: " + ", ".join(CONFIGS)
                        + " (default: all)")
    p.add_argument("--loaders", default=",".join(DEFAULT_LOADERS),
                   help="comma list of " + ", ".join(LOADER_NAMES) + " (default: all but imageloader_cuda)")
    p.add_argument("--loops", default=",".join(LOOPS), help="comma list of " + ", ".join(LOOPS))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a row per config, loader and loop each)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per row (a multiple of 50 for runs_ahead)")
    p.add_argument("--ceiling-steps", type=int, default=50, help="timed steps of each ceiling measurement")
    p.add_argument("--warmup", type=int, default=40, help="untimed steps of a fresh loader before its timed ones")
    p.add_argument("--data", default="/tmp/datapipe-bench-images", help="image shards (made there if missing)")
    p.add_argument("--num-images", type=int, default=20000, help="JPEGs to make when --data is empty")
    p.add_argument("--tokens-dir", default="/tmp/datapipe-scaling-tokens", help="token shards (made if missing)")
    p.add_argument("--docs", type=int, default=20000, help="documents to make when --tokens-dir is empty")
    p.add_argument("--batch-size", type=int, default=256, help="images per batch")
    p.add_argument("--image-size", type=int, default=224, help="crop size of the images")
    p.add_argument("--arch", default=None, help="torchvision model of every image row (default: each config's own, "
                                                "resnet50 or resnet18; a tiny CNN without torchvision)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row (TokenLoader)")
    p.add_argument("--token-batch", type=int, default=4, help="packed rows per batch (TokenLoader)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers of the dataloader rows")
    p.add_argument("--epoch-batches", type=int, default=64,
                   help="batches per epoch of the dataloader rows (64: a row crosses epoch starts; 5004: "
                        "ImageNet-1k's train split at batch 256)")
    p.add_argument("--profile", action="store_true", help="profile one runs_ahead window (ImageLoader, hand loop)")
    p.add_argument("--profile-configs", default="eager",
                   help="comma list of the row sets --profile profiles (default: eager)")
    p.add_argument("--rows", default="",
                   help="a probe: comma list of config/loader[/loop] rows run instead of the plan (loop default "
                        "runs_ahead; loader may be imageloader@hw<share>+t<threads>+q<depth>+nohold)")
    p.add_argument("--trace-dir", default=None, help="where the profiler's traces go (default: a temporary folder)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new row after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="smoke check of the harness: tiny data (its own folders, -quick* beside --data and "
                        "--tokens-dir), resnet18, torch.compile without inductor, a few steps; its ratios measure "
                        "nothing")
    p.add_argument("--out", default=None, help="results directory (default bench/results: a full run replaces "
                                               "ceiling.json there unless --append); written after every row")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to the ceiling.json already in --out, numbering its rounds on (the "
                        "same GPU only): a run of record split over two processes")
    p.add_argument("--first-round", type=int, default=None,
                   help="number of this run's first round (default: 0, or with --append the next of its row sets; "
                        "give it when one round is split over several runs)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_images, args.batch_size, args.image_size, args.arch = 64, 4, 32, "resnet18"
        args.steps, args.ceiling_steps, args.warmup, args.rounds = 2, 2, 1, min(args.rounds, 1)
        args.data = args.data.rstrip("/") + f"-quick{args.num_images}"  # its own folder per size
        args.tokens_dir, args.docs, args.seq_len, args.token_batch, args.workers = args.tokens_dir + "-quick", 200, 128, 2, 1
        args.epoch_batches = 2  # epochs end within a row
    args.device = torch.device(args.device)
    for opt, names, known in (("configs", "configs", CONFIGS), ("loaders", "loaders", LOADER_NAMES),
                              ("loops", "loops", LOOPS)):
        values = [x for x in getattr(args, opt).split(",") if x]
        for x in values:
            try:
                base = variant(x)[0] if opt == "loaders" else x
            except ValueError as e:
                p.error(str(e))
            if base not in known:
                p.error(f"unknown {opt[:-1]} {x!r}: use {', '.join(known)}")
        setattr(args, names, values)
    rows = []
    for item in filter(None, args.rows.split(",")):
        config, _, rest = item.partition("/")
        loader, _, loop = rest.partition("/")
        loop = loop or "runs_ahead"
        try:
            known = config in CONFIGS and loop in LOOPS and variant(loader)[0] in LOADER_NAMES
        except ValueError as e:
            p.error(str(e))
        if not known:
            p.error(f"--rows: {item!r} is not config/loader[/loop] of {', '.join(CONFIGS)} / "
                    f"{', '.join(LOADER_NAMES)} / {', '.join(LOOPS)}")
        rows.append((config, loader, loop))
    args.rows = rows
    if rows:
        args.loaders = sorted({r[1] for r in rows})
    args.profile_configs = [x for x in args.profile_configs.split(",") if x]
    for x in args.profile_configs:
        if x not in CONFIGS:
            p.error(f"unknown --profile-configs entry {x!r}: use {', '.join(CONFIGS)}")
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
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "usable_cores": len(os.sched_getaffinity(0)),
           "config": {k: str(v) for k, v in vars(args).items()}, "loops": LOOPS,
           "configs": {k: CONFIGS[k] for k in args.configs}, "rows": bench.rows}
    earlier = earlier_record(args) if args.append else {}
    if earlier:
        out = appended(earlier, out)
    first = args.first_round
    if first is None:  # --append: these row sets' rounds go on
        first = next_round([r for r in bench.rows if r.get("config") in args.configs])
    order = plan(args)
    skipped = 0
    for r in range(first, first + args.rounds):
        for config, name, loop in (order if r % 2 == 0 else order[::-1]):
            if time.perf_counter() - t0 > args.budget_s:
                skipped += 1
                continue
            bench.row(config, name, loop, r)
            out["summary"] = summary(bench.rows)
            write_result("ceiling", out, args.out)  # after every row: a call cut short keeps what it ran
    if skipped:
        out["budget_skipped_rows"] = skipped
    if args.profile and args.device.type == "cuda" and bench.cached:
        import tempfile

        trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="ceiling-trace-")
        earlier_profiles = out.get("profile") or []  # --append keeps the file's profiles beside this run's
        profiles = list(earlier_profiles) if isinstance(earlier_profiles, list) else [earlier_profiles]
        parts = [(config, "images") for config in args.profile_configs if "images" in bench.cached]
        if "eager" in args.profile_configs and "tokens" in bench.cached:
            parts.append(("eager", "tokens"))  # TokenLoader's row is an eager one
        for config, fmt in parts:  # after the rows, whatever --budget-s says (it bounds the rows)
            profiles.append(profile_part(bench, args, trace_dir, config, fmt))
            out["profile"] = profiles[0] if len(profiles) == 1 else profiles
            write_result("ceiling", out, args.out)
    out["summary"] = summary(bench.rows)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    path = write_result("ceiling", out, args.out)
    cols = ["config", "loader", "loop", "connections", "rows", "ceiling_ratio", "min", "max", "wait_fraction", "rate"]
    print(table(out["summary"], cols))
    print(f"wrote {path} ({out['seconds']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
