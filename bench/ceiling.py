"""Training at its data-free ceiling: each loader's rate over the same step fed one cached batch.

One run, one process, one GPU. The step: ResNet-50 (random init, bf16 autocast, channels_last,
SGD, batch 256), the training stream synchronised at each step end. The ceiling is that step
replaying one cached device batch (no loader); each loaded measurement sits between two ceiling
measurements of the same input format, so drift shows (``ceiling_before`` / ``ceiling_after``)
and ``ceiling_ratio`` = loaded rate / their mean. Loaders:

- ``imageloader``: ``loaders.ImageLoader`` defaults; ``il_*``: one option changed (variants; ``il_auto``:
  ``hw_decoder_load="auto"``, ``il_hw075``: the 0.75 share written out);
  ``il_cpu``: ``decode_device="cpu"`` (DALI decodes/augments on the CPU, pinned copy, normalise
  on the GPU), ``il_cpu_u8``: the same delivering uint8 NHWC (the step normalises);
  ``standalone``: the decode rate of the ``STANDALONE`` variants alone (no training step);
- ``kernels``: each ImageLoader variant of ``KERNEL_VARIANTS`` alone (no training), its device time
  per batch from the torch profiler, kernels apart from copies;
- ``dali_hand``: the hand-written DALI loop (readers.webdataset + mixed image_random_crop + resize
  + crop_mirror_normalize, DALIGenericIterator, in the training thread, labels fixed);
- ``torch_pil``: torch DataLoader + webdataset + PIL (torchvision transforms);
- ``dl_ours`` / ``dl_torch``: ``loaders.DataLoader(device="cuda")`` vs torch's DataLoader
  (``pin_memory=True``) + ``.cuda(non_blocking=True)`` over a map-style uint8 224x224 dataset that
  keeps up (the step normalises the uint8 batch; its ceiling replays a uint8 batch);
- ``tokens``: ``loaders.TokenLoader`` (4 x 4096 packed rows) feeding the small causal LM of
  bench/scaling.py (its own ceiling); ``tokens_llama``: the same rows feeding a ~162M-parameter
  Hugging Face Llama (random init from a LlamaConfig, bf16 weights, sdpa, AdamW,
  ``packing.batch.hf_inputs``).

Pacing: rows ending ``_unpaced`` run with ``pace=None`` (the loader's producer starts its next
batch as soon as a slot frees, as before pacing), ``_pace01`` ... ``_pace085`` with
that fraction; the others with the library's default (ImageLoader 0.7, DevicePrefetcher 0.5); any
image variant takes these suffixes (``il_hw0_pace085``). Rows ending ``_noretire``: the training
thread frees the batches it is done with (as before ``datapipe.device.handoff.Retirer`` moved that
to the producer thread). Rows ending ``_block`` / ``_yield`` / ``_spin`` (image variants and
``dl_*``) run with the CUDA context in that wait mode (``bench.wait_mode``), their ceilings too.
``tokens_worker``: the packing in one DataLoader worker process. Rows ending ``_single`` build DALI's
pipelines with ``StreamPolicy.SINGLE``; ``_legacy``
with DALI's legacy executor (``_copyout``: the default one, ImageLoader's outputs copied out, not
shared); ``_syncexec`` with a synchronous, unpipelined one (each batch made when the paced producer
asks); ``_nommap`` with DALI's reader reading shards by plain file I/O, not memory-mapped; ``_hostready`` /
``_eventready`` / ``_checkedready`` with ``ImageLoader(ready="host")`` / ``"event"`` / ``"checked"`` (how the producer's
batches are awaited: ``datapipe.device.side_stream``). Rows ending ``_sync10`` wait for the training stream every 10th step only, their ceilings too.
Suffixes combine, in any order (``imageloader_legacy_sync10``). A last character 2-9 or b-d repeats a
variant (``imageloader2``, ``il_hw075c``), before any suffix (``imageloader2_single``).

``--burn-in N`` runs one untimed ImageLoader pass of N steps before the first image row (the first
row of a process was its variant's lowest in four of five runs; ``results["burn_in"]``).

Loaders with worker processes are shut down, and the process waits for its children to exit
(``workers_exit_s``), before the ceiling after them is measured.

Where the rest goes: ``wait_fraction`` (host blocked in ``next()``), ``contention`` = 1 - ratio -
wait (the step itself ran slower: the loader's GPU work and host threads), and, profiled with
torch.profiler over a few steps, ``loader_device_ms_per_step``: device time of kernels and copies
whose names the ceiling's profile does not have (the loader's own); ``producer``: the loader's
producer thread's CPU time per batch (an upper bound on its share of the GIL). ``memory`` runs 100 short
ImageLoader epochs and records ``torch.cuda.memory_reserved()`` per epoch.

    python bench/ceiling.py                      # the H200 run: bench/results/ceiling.json
    python bench/ceiling.py --only imageloader,dali_hand --steps 40
    python bench/ceiling.py --quick              # CPU smoke check of the harness (tiny sizes)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import loaders.images.loader  # noqa: E402,F401 - first, as a training script imports it: before CUDA starts
import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import GpuSampler, endless, retiring, sync, table, to_device, write_result  # noqa: E402
from bench.models import PackedLM  # noqa: E402
from datapipe.units import percentiles  # noqa: E402

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DEFAULT_ONLY = ("imageloader,il_cpu,dali_hand,il_cpu_u8,imageloader2,il_cpu2,dali_hand2,standalone,torch_pil,dl_ours,"
                "dl_torch,tokens,tokens_llama,memory,profile")
# the variants measured once (bench/results/ceiling_variants.json): il_hw1,il_hw09,il_depth1,il_prio,il_stream;
# bench/results/ceiling_host_experiments.json: DALI outputs in host order, a DALI checkpoint every 8 batches,
# outputs copied out of DALI (no DLPack export), DALI_USE_VMM=0 / DALI_USE_CUDA_MALLOC_ASYNC=1, a 0.5 ms GIL
# switch interval, pacing at 0.1-0.3: none helped (bench/HISTORY.md, "Where the rest goes")


# ---- the steps ------------------------------------------------------------------------------------
class ImageStep:
    """ResNet-50 SGD step, bf16 autocast, channels_last. A uint8 batch (NCHW or NHWC) is normalised here."""

    def __init__(self, device: torch.device, arch: str = "resnet50", num_classes: int = 1000):
        try:
            import torchvision

            model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
        except ImportError:  # no torchvision (the CPU smoke check): a small CNN with the same input and loss
            model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(16, num_classes))
        self.device = device
        self.model = model.to(device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.mean = torch.tensor([m * 255 for m in MEAN], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in STD], device=device).view(1, 3, 1, 1)
        self.cuda = device.type == "cuda"

    def __call__(self, batch) -> None:
        x, y = batch
        if x.dtype == torch.uint8:
            if x.shape[-1] == 3:  # NHWC: a channels_last NCHW view
                x = x.permute(0, 3, 1, 2)
            x = (x.float() - self.mean) / self.std
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss_fn(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


class TokenStep:
    """The small causal LM of bench/scaling.py (d 512, 6 layers, sdpa with the packed block mask), AdamW."""

    def __init__(self, device: torch.device, seq_len: int, small: bool = False):
        d, heads, layers, vocab = (64, 4, 1, 32000) if small else (512, 8, 6, 32000)

        self.device = device
        self.model = PackedLM(vocab=vocab, d=d, heads=heads, layers=layers, seq_len=seq_len).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def __call__(self, batch) -> None:
        from packing.batch import attention_mask_for_sdpa

        mask = attention_mask_for_sdpa(batch["document_ids"])
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(batch["input_ids"].long(), batch["position_ids"].long(), mask)
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                               batch["labels"][:, 1:].flatten().long(), ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


class LlamaStep:
    """A Hugging Face Llama (random init from a LlamaConfig, ~162M parameters), bf16 weights, sdpa, AdamW.

    The packed batch goes in through ``packing.batch.hf_inputs`` (input_ids, position_ids, labels,
    no attention mask): transformers masks between the packed documents from the position ids.
    """

    def __init__(self, device: torch.device, seq_len: int, small: bool = False):
        from transformers import LlamaConfig, LlamaForCausalLM

        size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4) if small else
                dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12))
        config = LlamaConfig(vocab_size=32000, max_position_embeddings=seq_len, tie_word_embeddings=False,
                             attn_implementation="sdpa", **size)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
        self.model.train()
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def __call__(self, batch) -> None:
        from packing.batch import hf_inputs

        inputs = hf_inputs(batch)
        inputs = {k: v.long() if torch.is_tensor(v) else v for k, v in inputs.items()}
        loss = self.model(**inputs).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


# ---- timing -----------------------------------------------------------------------------------------
def timed(batches, step, *, steps: int, warmup: int, device: torch.device, count, stream=None) -> dict:
    """``steps`` steps after ``warmup``; time in ``next()`` is data wait; the training stream syncs each step."""
    import resource

    it = iter(batches)
    ctx = torch.cuda.stream(stream) if stream is not None else _Null()
    cpu0 = 0.0
    with ctx:
        waits = []
        units = 0
        start = None
        for i in range(warmup + steps):
            if i == warmup:
                sync(device)
                sampler = GpuSampler(device)
                waits, units, start = [], 0, time.perf_counter()
                ru = resource.getrusage(resource.RUSAGE_SELF)
                cpu0 = ru.ru_utime + ru.ru_stime
            t0 = time.perf_counter()
            batch = next(it)
            waits.append(time.perf_counter() - t0)
            step(batch)
            if device.type == "cuda" and ((i + 1) % SYNC_EVERY[0] == 0 or i == warmup + steps - 1):
                torch.cuda.current_stream(device).synchronize()  # the training stream, not the loader's
            units += count(batch)
        wall = time.perf_counter() - start
    gpu = sampler.stop()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {**gpu, "rate": units / wall, "wait_fraction": sum(waits) / wall, "step_ms": wall / steps * 1e3,
            **{f"wait_ms_{k}": v for k, v in percentiles(waits, qs=(50, 90), scale=1e3).items()},
            "seconds": wall, "cpu_cores_used": round((ru.ru_utime + ru.ru_stime - cpu0) / wall, 2)}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def replay(batch):
    """The data-free feed: the same cached device batch, forever."""
    while True:
        yield batch


# ---- loaders ----------------------------------------------------------------------------------------
ROW_OPTIONS: dict = {}  # the loader options of the row being run (its suffixes': pace, ready), set by loaded()


def row_option(*names: str) -> dict:
    """Those of the running row's loader options named (for the loaders that take them)."""
    return {k: v for k, v in ROW_OPTIONS.items() if k in names}


def image_loader(urls, args, **options):
    from loaders import ImageLoader

    return ImageLoader(urls, batch_size=args.batch_size, image_size=args.image_size, device=args.device,
                       **{**row_option("pace", "ready"), **options})


def dali_hand(urls, args):
    """The ten-line DALI loop a user writes, run in the training thread (labels fixed)."""
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from datapipe.tar.dali_index import default_index_path

    gpu = args.device.type == "cuda"
    pipe = Pipeline(batch_size=args.batch_size, num_threads=min(8, os.cpu_count() or 1),
                    device_id=0 if gpu else None, seed=0)
    with pipe:
        jpg = fn.readers.webdataset(paths=urls, index_paths=[default_index_path(u) for u in urls], ext=["jpg"],
                                    random_shuffle=True, initial_fill=2000, name="Reader")
        images = fn.decoders.image_random_crop(jpg, device="mixed" if gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, device="gpu" if gpu else "cpu", resize_x=args.image_size, resize_y=args.image_size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=fn.random.coin_flip())
        pipe.set_outputs(images)
    it = DALIGenericIterator(pipe, ["data"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP,
                             auto_reset=True)
    labels = torch.zeros(args.batch_size, dtype=torch.int64, device=args.device)
    while True:
        for out in it:
            yield out[0]["data"], labels


class Uint8Images(torch.utils.data.Dataset):
    """Map-style uint8 3x224x224 images (views of a random pool): cheap enough that 8 workers keep up."""

    def __init__(self, n: int, size: int):
        self.n = n
        self.pool = torch.randint(0, 255, (64, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.pool[i % 64].clone(), i % 1000


def torch_pil(urls, args):
    from bench.images import torch_dataloader

    ns = SimpleNamespace(image_size=args.image_size, batch_size=args.batch_size, workers=args.pil_workers,
                         device=args.device.type)
    loader = torch_dataloader(urls, ns)
    LOADERS.append(loader)
    return to_device(endless(loader), args.device)


# ---- parts ------------------------------------------------------------------------------------------
class Ceilings:
    """The data-free rate per input format, measured right before and after each loaded run."""

    def __init__(self, step, args, count):
        self.step, self.args, self.count = step, args, count
        self.batches: dict[str, object] = {}
        self.last: dict[str, float] = {}
        self.gpu: dict[str, dict] = {}  # the last ceiling measurement's SM clock and power, per format
        self.history: list[dict] = []

    def cache(self, fmt: str, batch) -> None:
        if fmt not in self.batches:
            self.batches[fmt] = _clone(batch)

    def measure(self, fmt: str) -> float:
        # a format's first measurement warms longer: its first ceiling read 4-12% low in earlier runs
        # (ceiling_before of dl_ours in bench/results/ceiling*.json), flattering the row after it
        warmup = 3 if fmt in self.last else max(3, self.args.ceiling_steps)
        r = timed(replay(self.batches[fmt]), self.step, steps=self.args.ceiling_steps, warmup=warmup,
                  device=self.args.device, count=self.count)
        self.last[fmt] = r["rate"]
        self.gpu[fmt] = {k: r[k] for k in ("sm_mhz", "power_w") if k in r}
        self.history.append({"format": fmt, "rate": round(r["rate"], 1), "t": round(time.perf_counter() - T0, 1),
                             **self.gpu[fmt]})
        return r["rate"]


def _clone(batch):
    if isinstance(batch, dict):
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    return tuple(v.clone() for v in batch)


T0 = time.perf_counter()


def loaded(name: str, make, fmt: str, ceilings: Ceilings, step, args, count, results: dict, stream=None,
           steps=None) -> None:
    """Ceiling, loaded, ceiling: one row of results; its loaders take the options its suffixes set (``row_options``)."""
    print(f"[{name}] ...", file=sys.stderr, flush=True)
    ROW_OPTIONS.clear()
    ROW_OPTIONS.update(row_options(name))
    gen = None
    children = set(_children())  # those of earlier parts (e.g. a dataset writer pool) are not this row's
    # rows ending _noretire: the training thread frees handed-out batches itself (before Retirer)
    with retiring("_noretire" not in row_suffixes(name)):
        try:
            gen = make()
            it = iter(gen)
            first = next(it)
            ceilings.cache(fmt, first)
            before = ceilings.last.get(fmt) or ceilings.measure(fmt)
            r = timed(it, step, steps=steps or args.steps, warmup=args.warmup, device=args.device, count=count,
                      stream=stream)
            stats = _loader_stats(gen)
        except Exception as e:  # one broken candidate must not cost the others' numbers
            traceback.print_exc()
            results[name] = {"error": repr(e)[:500]}
            gen = it = None
            shutdown_workers(ignore=children, timeout=20)
            return
        finally:
            if gen is not None and hasattr(gen, "close"):
                gen.close()
            gen = it = None
            ROW_OPTIONS.clear()
    exited = shutdown_workers(ignore=children)  # worker processes gone before the ceiling after them
    time.sleep(1.0)
    after = ceilings.measure(fmt)
    ceiling = (before + after) / 2
    ratio = r["rate"] / ceiling
    results[name] = {
        "rate": round(r["rate"], 1), "ceiling": round(ceiling, 1), "ceiling_before": round(before, 1),
        "ceiling_after": round(after, 1), "ceiling_ratio": round(ratio, 4),
        "wait_fraction": round(r["wait_fraction"], 4), "contention": round(max(0.0, 1 - ratio - r["wait_fraction"]), 4),
        "step_ms": round(r["step_ms"], 2), "wait_ms_p50": round(r["wait_ms_p50"], 2),
        "wait_ms_p90": round(r["wait_ms_p90"], 2), "cpu_cores_used": r["cpu_cores_used"], "input": fmt,
        **{k: r[k] for k in ("sm_mhz", "power_w") if k in r},
        **{f"ceiling_{k}": v for k, v in ceilings.gpu.get(fmt, {}).items()},
        **exited, **stats,
    }
    print(f"    {results[name]}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def copied_outputs_row(name: str):
    """Rows ending ``_copyout``: ImageLoader copies DALI's outputs out instead of sharing them through DLPack."""
    if "_copyout" not in row_suffixes(name):
        yield
        return
    from loaders.images.loader import ImageLoader

    to_torch = ImageLoader._to_torch
    ImageLoader._to_torch = lambda self, tl, stream, zero_copy=True: to_torch(self, tl, stream, zero_copy=False)
    try:
        yield
    finally:
        ImageLoader._to_torch = to_torch


SYNC_EVERY = [1]  # the training loop waits for its stream every this many steps (rows ending _sync10: 10)


@contextlib.contextmanager
def sync_every_row(name: str, ceilings: Ceilings):
    """Rows ending ``_sync10`` wait for the training stream every 10th step only (as a loop that logs its
    loss every 10 steps), and so do their ceilings; the next row measures its own again."""
    if "_sync10" not in row_suffixes(name):
        yield
        return
    SYNC_EVERY[0] = 10
    ceilings.last.clear()
    try:
        yield
    finally:
        SYNC_EVERY[0] = 1
        ceilings.last.clear()


@contextlib.contextmanager
def dali_pipeline_row(name: str):
    """DALI pipelines built during the row take its suffixes' settings (``_syncexec`` overrides the builder's;
    the others apply where the builder left the choice to DALI):
    ``_single``: ``StreamPolicy.SINGLE`` (one stream for all operators, so fewer cross-stream events);
    ``_legacy``: the legacy pipelined executor (output buffers recycled, so nothing is freed per batch;
    ImageLoader copies its outputs out); ``_syncexec``: neither asynchronous nor pipelined, so each batch is
    made inside the producer's ``pipe.run()``, when the (paced) producer asks, not whenever DALI's own
    prefetch frees a slot; ``_nommap``: ``readers.webdataset(dont_use_mmap=True)``, shards read with plain file
    I/O, not memory-mapped (bench/HISTORY.md, "ImageLoader's shards read without memory mapping"). Other rows: DALI's
    defaults."""
    suffixes = row_suffixes(name)
    if not {"_single", "_legacy", "_syncexec", "_nommap"} & set(suffixes):
        yield
        return
    import nvidia.dali.fn.readers as dali_readers
    import nvidia.dali.pipeline as dali_pipeline

    webdataset = dali_readers.webdataset
    if "_nommap" in suffixes:  # the reader reads shards with plain file I/O, no memory-mapped shards
        dali_readers.webdataset = lambda *a, **kw: webdataset(*a, **{**kw, "dont_use_mmap": True})

    settings, forced = {}, {}
    if "_single" in suffixes:
        settings["stream_policy"] = dali_pipeline.StreamPolicy.SINGLE
    if "_legacy" in suffixes:
        settings["exec_dynamic"] = False
    if "_syncexec" in suffixes:
        forced.update(exec_async=False, exec_pipelined=False)
    original = dali_pipeline.Pipeline

    class RowPipeline(original):
        def __init__(self, *a, **kw):
            kw.update({k: v for k, v in settings.items() if kw.get(k) is None})
            kw.update(forced)
            super().__init__(*a, **kw)

    dali_pipeline.Pipeline = RowPipeline
    try:
        yield
    finally:
        dali_pipeline.Pipeline = original
        dali_readers.webdataset = webdataset


@contextlib.contextmanager
def wait_mode_row(name: str, ceilings: Ceilings, device: torch.device, results: dict):
    """Run row ``name`` with the CUDA context in its wait mode (``row_wait``; None: unchanged); its
    ceilings are measured in that mode too, and the next row measures its own again."""
    mode = row_wait(name)
    if mode is None or device.type != "cuda":
        yield
        return
    from bench.wait_mode import set_wait_mode

    previous = set_wait_mode(mode, device)
    ceilings.last.clear()
    try:
        yield
    finally:
        set_wait_mode(previous, device)
        ceilings.last.clear()
        if isinstance(results.get(name), dict):
            results[name]["wait_mode"] = mode


LOADERS: list = []


def _children() -> list[int]:
    """Pids of this process's live children (any kind: multiprocessing, torch workers, forks)."""
    pids = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        import multiprocessing

        pids = [p.pid for p in multiprocessing.active_children()]
    return pids


def shutdown_workers(ignore: set = frozenset(), timeout: float = 30.0) -> dict:
    """Shut the tracked loaders' workers down and wait until this process has no child left."""
    import gc
    import multiprocessing

    t0 = time.perf_counter()
    for loader in LOADERS:
        close = getattr(loader, "close", None)  # loaders.DataLoader / ImageLoader-like
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        torch_iter = getattr(loader, "_iterator", None)  # torch's persistent workers
        if torch_iter is not None and hasattr(torch_iter, "_shutdown_workers"):
            torch_iter._shutdown_workers()
    gc.collect()  # iterators of non-persistent workers shut them down when collected
    while True:
        multiprocessing.active_children()  # joins the finished ones
        left = [p for p in _children() if p not in ignore]
        if not left or time.perf_counter() - t0 > timeout:
            break
        time.sleep(0.05)
    return {"workers_exit_s": round(time.perf_counter() - t0, 2), "workers_left": len(left)}


def _loader_stats(gen) -> dict:
    loader = LOADERS[-1] if LOADERS else None
    if loader is not None and hasattr(loader, "stats"):
        try:
            s = loader.stats()
            out = {"loader_seconds": {k: round(v, 3) for k, v in s.get("seconds", {}).items()}}
            if "producer" in s:  # the producer thread's CPU time per batch (bounds its share of the GIL)
                out["producer"] = s["producer"]
            if "decoder" in s:  # ImageLoader: the decoder share in use, and whether "auto" switched
                out["decoder"] = s["decoder"]
            return out
        except Exception:  # noqa: BLE001
            return {}
    return {}


def tracked(loader):
    LOADERS.append(loader)
    return endless(loader)


def image_variants(urls, args, hp) -> dict:
    """The image rows' variants: name -> (input format, make the loader, the training stream or None).
    Nothing is built until a ``make`` is called (``image_variants(None, None, None)`` lists the names)."""
    return {
        "imageloader": ("f32", lambda: tracked(image_loader(urls, args)), None),
        "il_auto": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load="auto")), None),
        "dali_hand": ("f32", lambda: dali_hand(urls, args), None),
        "il_hw1": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=1.0)), None),
        "il_hw09": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=0.9)), None),
        "il_hw0": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=0.0)), None),
        "il_hw075": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=0.75)), None),
        "il_hw0_t12": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=0.0, num_threads=12)), None),
        "il_hw05": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=0.5)), None),
        "il_hw03": ("f32", lambda: tracked(image_loader(urls, args, hw_decoder_load=0.3)), None),
        "il_depth1": ("f32", lambda: tracked(image_loader(urls, args, prefetch_queue_depth=1)), None),
        "il_noaa": ("f32", lambda: tracked(image_loader(urls, args, antialias=False)), None),
        "il_threads4": ("f32", lambda: tracked(image_loader(urls, args, num_threads=4)), None),
        "il_u8": ("u8nhwc", lambda: tracked(image_loader(urls, args, dtype=torch.uint8, layout="NHWC")), None),
        "il_prio": ("f32", lambda: tracked(image_loader(urls, args)), hp),
        "il_stream": ("f32", lambda: tracked(image_loader(urls, args, reader="stream")), None),
        "il_cpu": ("f32", lambda: tracked(image_loader(urls, args, decode_device="cpu")), None),
        "il_cpu_u8": ("u8nhwc", lambda: tracked(image_loader(urls, args, decode_device="cpu", dtype=torch.uint8,
                                                             layout="NHWC")), None),
    }


def image_parts(args, urls, results) -> None:
    step = ImageStep(args.device, args.arch)
    count = lambda b: int(b[0].shape[0])  # noqa: E731
    ceilings = Ceilings(step, args, count)
    only = args.only
    hp = torch.cuda.Stream(args.device, priority=-1) if args.device.type == "cuda" else None
    variants = image_variants(urls, args, hp)
    if args.burn_in > 0 and any(variant_of(name, variants) for name in only):
        results["burn_in"] = burn_in(urls, args, step, count)
    for name in only:
        base = variant_of(name, variants)
        if base is not None and time.perf_counter() - T0 < args.budget_s:
            fmt, make, stream = variants[base]
            LOADERS.clear()
            with wait_mode_row(name, ceilings, args.device, results), dali_pipeline_row(name), \
                    copied_outputs_row(name), sync_every_row(name, ceilings):
                loaded(name, make, fmt, ceilings, step, args, count, results, stream=stream)
    if "standalone" in only and time.perf_counter() - T0 < args.budget_s:
        results["standalone"] = {}
        for name, options in STANDALONE.items():
            LOADERS.clear()
            try:
                results["standalone"][name] = standalone(image_loader(urls, args, **options), args)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                results["standalone"][name] = {"error": repr(e)[:300]}
        print(f"    standalone {results['standalone']}", file=sys.stderr, flush=True)
    if "torch_pil" in only and time.perf_counter() - T0 < args.budget_s:
        loaded("torch_pil", lambda: torch_pil(urls, args), "f32", ceilings, step, args, count, results,
               steps=max(10, args.steps // 3))
    for name in only:
        if row_base(name) not in ("dl_ours", "dl_torch") or time.perf_counter() - T0 > args.budget_s:
            continue
        from loaders import DataLoader

        ds = Uint8Images(args.batch_size * (args.steps + args.warmup + 4), args.image_size)
        common = dict(batch_size=args.batch_size, num_workers=args.dl_workers, shuffle=True, drop_last=True,
                      persistent_workers=True, prefetch_factor=2)
        LOADERS.clear()
        if name.startswith("dl_ours"):
            make = lambda: tracked(DataLoader(ds, device=args.device, **row_option("pace"), **common))  # noqa: E731
        else:
            make = lambda: to_device(tracked(torch.utils.data.DataLoader(  # noqa: E731
                ds, pin_memory=args.device.type == "cuda", **common)), args.device)
        with wait_mode_row(name, ceilings, args.device, results), sync_every_row(name, ceilings):
            loaded(name, make, "u8nchw", ceilings, step, args, count, results)
    if "kernels" in only and args.device.type == "cuda":
        results["kernels"] = loader_kernels(urls, args)
    if "profile" in only and args.device.type == "cuda" and time.perf_counter() - T0 < args.budget_s:
        try:
            results["profile"] = profile(urls, args, step, ceilings)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["profile"] = {"error": repr(e)[:500]}
    results["ceiling_history"] = ceilings.history


def burn_in(urls, args, step, count) -> dict:
    """One untimed ImageLoader pass of ``args.burn_in`` steps before the first image row: the process's
    first row (DALI's first pipeline, allocator growth) was its variant's lowest in four of five runs."""
    batches = iter(image_loader(urls, args))  # one pass; closing it stops its producer thread
    try:
        r = timed(batches, step, steps=args.burn_in, warmup=0, device=args.device, count=count)
    finally:
        batches.close()
    print(f"[burn-in] {args.burn_in} steps, {r['rate']:.1f} img/s (not a row)", file=sys.stderr, flush=True)
    return {"steps": args.burn_in, "images_per_s": round(r["rate"], 1)}  # not "rate": no row of the table


# the loaders timed alone (part "standalone"): can each feed a faster step?
STANDALONE = {"imageloader": {}, "il_hw0": {"hw_decoder_load": 0.0}, "il_hw05": {"hw_decoder_load": 0.5},
              "il_hw03": {"hw_decoder_load": 0.3},
              "il_hw0_t12": {"hw_decoder_load": 0.0, "num_threads": 12},
              "il_hw0_t14": {"hw_decoder_load": 0.0, "num_threads": 14}, "il_cpu": {"decode_device": "cpu"}}


def standalone(loader, args, batches: int = 30) -> dict:
    """Images/s of a loader alone (no training step): can it feed the step at all?"""
    it = iter(endless(loader))
    for _ in range(5):
        next(it)
    sync(args.device)
    t0 = time.perf_counter()
    n = sum(int(next(it)[0].shape[0]) for _ in range(batches))
    sync(args.device)
    rate = n / (time.perf_counter() - t0)
    it.close()
    shutdown_workers()
    return {"images_per_s": round(rate, 1), "num_threads": loader.num_threads}


def _kernels(prof) -> dict[str, float]:
    """Device time (ms) by kernel/copy name from a torch.profiler run."""
    out: dict[str, float] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    return out


# (bench/results/ceiling_retire_experiment.json also has color_after_resize variants: decode to YCbCr,
# convert after the resize; DALI converted the hardware decoder's RGB to YCbCr first: 2.5x the kernel time)
KERNEL_VARIANTS = {"imageloader": {}, "il_hw0": {"hw_decoder_load": 0.0}, "il_hw05": {"hw_decoder_load": 0.5},
                   "il_hw1": {"hw_decoder_load": 1.0}}


def loader_kernels(urls, args, batches: int = 20) -> dict:
    """Each ImageLoader variant alone (no training step): its device time per batch, kernels apart from copies."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    out = {}
    for name, options in KERNEL_VARIANTS.items():
        it = iter(endless(image_loader(urls, args, **options)))
        try:
            for _ in range(6):
                next(it)
            sync(args.device)
            t0 = time.perf_counter()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(batches):
                    next(it)
                sync(args.device)
            wall = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[name] = {"error": repr(e)[:300]}
            continue
        finally:
            it.close()
        k = _kernels(prof)
        copies = sum(v for key, v in k.items() if key.startswith(("Memcpy", "Memset")))
        top = sorted(((key, v) for key, v in k.items() if not key.startswith(("Memcpy", "Memset"))),
                     key=lambda kv: -kv[1])[:6]
        out[name] = {"kernel_ms_per_batch": round((sum(k.values()) - copies) / batches, 3),
                     "copy_ms_per_batch": round(copies / batches, 3),
                     "images_per_s_profiled": round(batches * args.batch_size / wall, 1),
                     "top": [(key[:70], round(v / batches, 3)) for key, v in top]}
        print(f"    kernels {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def profile(urls, args, step, ceilings) -> dict:
    """Per step: device time of the loader's own kernels/copies (names absent from the ceiling's profile)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    n = 8
    count = lambda b: int(b[0].shape[0])  # noqa: E731

    def run(batches):
        it = iter(batches)
        for _ in range(4):
            step(next(it))
        sync(args.device)
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step(next(it))
                torch.cuda.current_stream().synchronize()
            sync(args.device)
        return _kernels(prof)

    base = run(replay(ceilings.batches["f32"]))
    out = {"ceiling_device_ms_per_step": round(sum(base.values()) / n, 2)}
    candidates = [("imageloader", lambda: tracked(image_loader(urls, args))),
                  ("dali_hand", lambda: dali_hand(urls, args))]
    if any(n.startswith("il_cpu") for n in args.only):
        candidates.append(("il_cpu", lambda: tracked(image_loader(urls, args, decode_device="cpu"))))
    for name, make in candidates:
        gen = make()
        try:
            k = run(gen)
        finally:
            gen.close()
        own = {key: v for key, v in k.items() if key not in base}
        top = sorted(own.items(), key=lambda kv: -kv[1])[:8]
        out[name] = {"device_ms_per_step": round(sum(k.values()) / n, 2),
                     "loader_device_ms_per_step": round(sum(own.values()) / n, 2),
                     "top": [(key[:80], round(v / n, 3)) for key, v in top]}
        print(f"    profile {name}: {out[name]}", file=sys.stderr, flush=True)
    del count
    return out


ROW_PACE = {"_unpaced": 0.0, "_pace01": 0.1, "_pace02": 0.2, "_pace03": 0.3, "_pace05": 0.5, "_pace07": 0.7,
            "_pace08": 0.8, "_pace085": 0.85}  # rows named so override the pacing


ROW_WAIT = {"_block": "blocking", "_yield": "yield", "_spin": "spin"}  # rows named so set the CUDA wait mode

ROW_READY = {"_hostready": "host", "_eventready": "event", "_checkedready": "checked"}  # ImageLoader(ready=)

ROW_SUFFIXES = (*ROW_PACE, *ROW_WAIT, *ROW_READY, "_noretire", "_single", "_legacy", "_syncexec", "_copyout", "_sync10",
                "_nommap")
REPEAT_MARKS = "23456789bcd"  # a row name's last character that repeats a variant: imageloader2, il_hw075b


def row_suffixes(name: str) -> list[str]:
    """The suffixes a row's name ends with, last first (``imageloader_legacy_sync10``: ``_sync10``, ``_legacy``)."""
    found = []
    while True:
        k = next((k for k in ROW_SUFFIXES if name.endswith(k)), None)
        if k is None:
            return found
        found.append(k)
        name = name[:-len(k)]


def row_base(name: str) -> str:
    """The variant a row runs: its name less its suffixes (``il_hw0_pace07`` -> ``il_hw0``)."""
    for k in row_suffixes(name):
        name = name[:-len(k)]
    return name


def variant_of(name: str, variants) -> str | None:
    """The entry of ``variants`` a row runs: its :func:`row_base`, less a repeat mark (``il_hw075c`` -> ``il_hw075``)."""
    base = row_base(name)
    if base in variants:
        return base
    if base[-1:] in REPEAT_MARKS and base[:-1] in variants:
        return base[:-1]
    return None


def row_wait(name: str) -> str | None:
    """The CUDA wait mode a row runs in (``bench.wait_mode``): its suffix's, else None (unchanged)."""
    return next((ROW_WAIT[k] for k in row_suffixes(name) if k in ROW_WAIT), None)


def row_pace(name: str) -> float | None:
    """The ``pace`` a row's loader runs with: its suffix's (0.0: None, off), else None (the library's default)."""
    return next((ROW_PACE[k] for k in row_suffixes(name) if k in ROW_PACE), None)


def row_options(name: str) -> dict:
    """The loader options a row's suffixes set: ``pace`` (``_unpaced``: None, off) and ``ready``."""
    pace, ready = row_pace(name), row_ready(name)
    return {**({} if pace is None else {"pace": pace or None}), **({} if ready is None else {"ready": ready})}


def row_ready(name: str) -> str | None:
    """The ``ready`` a row's ImageLoader runs with: its suffix's, else None (the library's default)."""
    return next((ROW_READY[k] for k in row_suffixes(name) if k in ROW_READY), None)


class TokenBatches(torch.utils.data.IterableDataset):
    """TokenLoader's packed host batches, as a dataset a DataLoader worker can run."""

    def __init__(self, urls, seq_len: int, batch_size: int):
        self.urls, self.seq_len, self.batch_size = urls, seq_len, batch_size

    def __iter__(self):
        from loaders import TokenLoader

        yield from TokenLoader(self.urls, seq_len=self.seq_len, batch_size=self.batch_size, device=None)


def token_part(args, results) -> None:
    from bench.common import ensure_tokens
    from loaders import TokenLoader

    urls = ensure_tokens(args.tokens_dir, args.docs, 0)
    step = TokenStep(args.device, args.seq_len, small=args.quick)
    count = lambda b: int(b["input_ids"].numel())  # noqa: E731
    ceilings = Ceilings(step, args, count)

    def make():
        loader = TokenLoader(urls, seq_len=args.seq_len, batch_size=args.token_batch, device=args.device,
                             **row_option("pace"))
        return tracked(loader)

    def in_worker():  # the packing in one worker process; this process only pins and copies
        from loaders import DataLoader

        dataset = TokenBatches(urls, args.seq_len, args.token_batch)
        return tracked(DataLoader(dataset, batch_size=None, num_workers=1, device=args.device, **row_option("pace"),
                                  persistent_workers=True, prefetch_factor=4))

    for name, maker in (("tokens", make), ("tokens_unpaced", make), ("tokens_pace07", make),
                        ("tokens_noretire", make), ("tokens_worker", in_worker), ("tokens2", make)):
        if name in args.only and time.perf_counter() - T0 < args.budget_s + 60:
            LOADERS.clear()
            loaded(name, maker, "tokens", ceilings, step, args, count, results)
    if "tokens_llama" in args.only and time.perf_counter() - T0 < args.budget_s + 90:
        del step, ceilings
        try:
            llama = LlamaStep(args.device, args.seq_len, small=args.quick)
        except ImportError as e:  # no transformers here
            results["tokens_llama"] = {"error": repr(e)[:300]}
            return
        LOADERS.clear()
        loaded("tokens_llama", make, "tokens_llama", Ceilings(llama, args, count), llama, args, count, results)
        results["tokens_llama"]["parameters"] = llama.parameters


def memory_part(args, urls, results) -> None:
    """100 short ImageLoader epochs (a partial last batch each): memory_reserved per epoch must stay flat."""
    import resource

    from loaders import ImageLoader

    batch = max(2, args.batch_size * 3 // 4)
    loader = ImageLoader(urls[:3], batch_size=batch, image_size=args.image_size, device=args.device,
                         drop_last=False)
    reserved, rss = [], []
    for epoch in range(args.memory_epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            pass
        sync(args.device)
        reserved.append(torch.cuda.memory_reserved(args.device) if args.device.type == "cuda" else 0)
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    mb = [r / 2**20 for r in reserved]
    results["memory"] = {"epochs": args.memory_epochs, "batch_size": batch, "images_per_epoch": len(loader.stream),
                         "reserved_mb_epoch1": round(mb[0], 1), "reserved_mb_epoch10": round(mb[min(9, len(mb) - 1)], 1),
                         "reserved_mb_last": round(mb[-1], 1),
                         "growth_mb_after_epoch10": round(mb[-1] - mb[min(9, len(mb) - 1)], 1),
                         "max_rss_mb_epoch10": round(rss[min(9, len(rss) - 1)] / 1024, 1),
                         "max_rss_mb_last": round(rss[-1] / 1024, 1)}
    print(f"[memory] {results['memory']}", file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", default="/tmp/datapipe-bench-images")
    p.add_argument("--num-images", type=int, default=20000)
    p.add_argument("--tokens-dir", default="/tmp/datapipe-scaling-tokens")
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--token-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="timed loaded steps per loader")
    p.add_argument("--ceiling-steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--burn-in", type=int, default=0,
                   help="untimed ImageLoader steps before the first image row (process warm-up; 0: none)")
    p.add_argument("--pil-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--dl-workers", type=int, default=8)
    p.add_argument("--memory-epochs", type=int, default=100)
    p.add_argument("--budget-s", type=float, default=420, help="start no new part after this many seconds")
    p.add_argument("--only", default=DEFAULT_ONLY, help="comma list of parts")
    p.add_argument("--quick", action="store_true", help="CPU smoke check: tiny data, resnet18, a few steps")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.device = "cpu"
        args.num_images, args.batch_size, args.image_size, args.arch = 96, 8, 64, "resnet18"
        args.steps, args.ceiling_steps, args.warmup, args.memory_epochs = 3, 2, 1, 3
        args.data = args.data.rstrip("/") + "-quick"
        args.tokens_dir, args.docs, args.seq_len, args.token_batch = args.tokens_dir + "-quick", 400, 256, 2
        args.pil_workers, args.dl_workers = 1, 1
    args.device = torch.device(args.device)
    args.only = [x for x in args.only.split(",") if x]
    if args.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    from bench.images import ensure_dataset

    per_shard = 256 if not args.quick else 16
    urls, generation = ensure_dataset(args.data, args.num_images, workers=os.cpu_count() or 1, per_shard=per_shard)
    print(f"data ready at {time.perf_counter() - T0:.0f} s", file=sys.stderr, flush=True)
    results: dict = {}
    out = {"gpu": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
           "cpu_count": os.cpu_count(), "config": {k: str(v) for k, v in vars(args).items()},
           "generation": generation, "results": results}
    try:
        import nvidia.dali as dali

        out["dali"] = dali.__version__
    except ImportError:
        pass
    image_parts(args, urls, results)
    write_result("ceiling", out, args.out)
    if {"tokens", "tokens_llama"} & set(args.only) and time.perf_counter() - T0 < args.budget_s + 60:
        token_part(args, results)
        write_result("ceiling", out, args.out)
    if "memory" in args.only and time.perf_counter() - T0 < args.budget_s + 90:
        try:
            memory_part(args, urls, results)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["memory"] = {"error": repr(e)[:500]}
    path = write_result("ceiling", out, args.out)
    columns = ["rate", "ceiling", "ceiling_before", "ceiling_after", "ceiling_ratio", "wait_fraction", "contention",
               "cpu_cores_used", "sm_mhz", "ceiling_sm_mhz", "power_w", "ceiling_power_w"]
    rows = [{"loader": k, **{c: v.get(c) for c in columns}}
            for k, v in results.items() if isinstance(v, dict) and "rate" in v]
    print(table(rows, ["loader", *columns]))
    for k in ("memory", "profile", "standalone", "kernels"):
        if k in results:
            print(k, results[k])
    print(f"wrote {path} ({time.perf_counter() - T0:.0f} s)")
    return out


if __name__ == "__main__":
    main()
