"""Scaling run: ImageLoader and TokenLoader feeding N GPUs of one host, one process per GPU (torchrun).

    torchrun --nproc_per_node=N bench/scaling.py [--parts images,tokens] [--steps 100]

Each rank trains its own DDP replica: a ResNet-50 (bf16, channels_last; torchvision) fed by
``loaders.ImageLoader``, then a small causal LM fed by packed ``loaders.TokenLoader`` batches.
Per rank it measures images/s or tokens/s, the data-wait fraction (time in ``next()`` / wall, the
training stream synchronised at each step end) and CPU cores used. Rank 0 gathers them and merges
the result for this world size into ``scaling.json`` (``runs[<N>]``); with the 1-process run in
the same file it reports the scaling efficiency (per-GPU throughput at N / at 1).

Without CUDA it runs the same code on CPU with gloo and tiny sizes (``--device cpu``), which is
how it is checked on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import environment  # noqa: E402
from bench.models import PackedLM  # noqa: E402


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ensure_images(directory: str, n: int, rank: int) -> list[str]:
    from datapipe.tar.manifest import read_manifest
    from datapipe.tools.synthetic import make_image_dataset

    if rank == 0 and (read_manifest(directory) or {}).get("num_samples") != n:
        make_image_dataset(directory, num_images=n, num_classes=1000, shard_max_count=256,
                           num_workers=os.cpu_count() or 1, progress=False)
    dist.barrier()
    return [os.path.join(directory, s["name"]) for s in read_manifest(directory)["shards"]]


def ensure_tokens(directory: str, docs: int, rank: int) -> list[str]:
    from datapipe import ShardWriter
    from datapipe.tar.manifest import read_manifest

    if rank == 0 and (read_manifest(directory) or {}).get("num_samples") != docs:
        rng = np.random.default_rng(0)
        lengths = np.clip(rng.lognormal(6.5, 1.0, docs).astype(int), 1, 8192)
        with ShardWriter(os.path.join(directory, "tok-%05d.tar"), max_count=2000) as writer:
            for i, n in enumerate(lengths):
                buf = io.BytesIO()
                np.save(buf, rng.integers(0, 32000, n, dtype=np.int32))
                writer.write({"__key__": f"{i:08d}", "npy": buf.getvalue()})
    if dist.is_initialized():
        dist.barrier()
    return [os.path.join(directory, s["name"]) for s in read_manifest(directory)["shards"]]


def timed_training(batches, step, *, steps: int, warmup: int, device: torch.device, count) -> dict:
    """Run ``step`` on ``steps`` batches after ``warmup``; time in next() is data wait."""
    it = iter(batches)
    wait = 0.0
    units = done = 0
    start = cpu0 = None
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            wait, units, done, start, cpu0 = 0.0, 0, 0, time.perf_counter(), cpu_seconds()
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(batches)
            batch = next(it)
        wait += time.perf_counter() - t0
        step(batch)
        if device.type == "cuda":  # the training stream only: the loader's own GPU work runs on
            torch.cuda.current_stream(device).synchronize()
        units += count(batch)
        done += 1
    wall = time.perf_counter() - start
    return {"steps": done, "units": units, "seconds": wall, "per_s": units / wall, "wait_fraction": wait / wall,
            "cpu_cores_used": (cpu_seconds() - cpu0) / wall}


def image_part(args, rank: int, world: int, device: torch.device) -> dict:
    from loaders import ImageLoader

    urls = ensure_images(args.images_dir, args.images, rank)
    cuda = device.type == "cuda"
    threads = args.threads or max(1, (os.cpu_count() or 1) // world - 1)
    loader = ImageLoader(urls, batch_size=args.batch_size, image_size=args.image_size, train=True,
                         device=device, num_threads=threads, read_workers=args.read_workers, reader=args.reader)
    try:
        import torchvision

        model = torchvision.models.resnet50(weights=None) if args.model == "resnet50" else None
    except ImportError:
        model = None
    if model is None:  # no torchvision (CPU check): a small CNN with the same input and loss
        model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(16, 1000))
    model = model.to(device, memory_format=torch.channels_last)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(batch):
        x, y = batch
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(ddp(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    if cuda:
        torch.backends.cudnn.benchmark = True
    r = timed_training(loader, step, steps=args.steps, warmup=args.warmup, device=device, count=lambda b: len(b[1]))
    r["dali_threads"] = threads
    r["reader"] = loader.reader
    r["loader_seconds"] = loader.stats()["seconds"]
    return r


def token_part(args, rank: int, world: int, device: torch.device) -> dict:
    from loaders import TokenLoader
    from packing.batch import attention_mask_for_sdpa

    urls = ensure_tokens(args.tokens_dir, args.docs, rank)
    cuda = device.type == "cuda"
    d, heads, layers, vocab = (512, 8, 6, 32000) if cuda else (64, 4, 1, 32000)

    ddp = nn.parallel.DistributedDataParallel(
        PackedLM(vocab=vocab, d=d, heads=heads, layers=layers, seq_len=args.seq_len).to(device), device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    loader = TokenLoader(urls, seq_len=args.seq_len, batch_size=args.token_batch, device=device)

    def step(batch):
        mask = attention_mask_for_sdpa(batch["document_ids"])
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = ddp(batch["input_ids"].long(), batch["position_ids"].long(), mask)
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                               batch["labels"][:, 1:].flatten().long(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return timed_training(loader, step, steps=args.steps, warmup=args.warmup, device=device,
                          count=lambda b: int((b["document_ids"] >= 0).sum()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--parts", default="images,tokens")
    p.add_argument("--images-dir", default="/tmp/datapipe-scaling-images")
    p.add_argument("--tokens-dir", default="/tmp/datapipe-scaling-tokens")
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--read-workers", type=int, default=0)
    p.add_argument("--reader", default="auto", choices=["auto", "stream", "dali"], help="ImageLoader reader")
    p.add_argument("--threads", type=int, default=0, help="DALI threads per rank (default: cores / ranks - 1)")
    p.add_argument("--model", default="resnet50", choices=["resnet50", "small"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--token-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny sizes for a CPU check")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scaling.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.docs, args.batch_size, args.image_size = 64, 400, 8, 64
        args.seq_len, args.token_batch, args.steps, args.warmup, args.model = 256, 2, 4, 1, "small"
        args.images_dir += "-quick"
        args.tokens_dir += "-quick"

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mine = {"rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    for part in args.parts.split(","):
        mine[part] = (image_part if part == "images" else token_part)(args, rank, world, device)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        report(args, world, ranks)
    dist.barrier()
    dist.destroy_process_group()


def report(args, world: int, ranks: list[dict]) -> None:
    run = {"world_size": world, "ranks": ranks, "config": {k: v for k, v in vars(args).items()}}
    for part in args.parts.split(","):
        per = [r[part]["per_s"] for r in ranks]
        run[part] = {"per_gpu_mean": sum(per) / world, "per_gpu_min": min(per), "total": sum(per),
                     "max_wait_fraction": max(r[part]["wait_fraction"] for r in ranks),
                     "steps_per_rank": sorted({r[part]["steps"] for r in ranks}),
                     "cpu_cores_used": sum(r[part]["cpu_cores_used"] for r in ranks)}
    try:
        with open(args.out) as f:
            results = json.load(f)
    except (OSError, ValueError):
        results = {"runs": {}}
    results["environment"] = environment()
    results["runs"][str(world)] = run
    base = results["runs"].get("1")
    for part in args.parts.split(","):
        if base and part in base:
            run[part]["scaling_efficiency"] = run[part]["per_gpu_mean"] / base[part]["per_gpu_mean"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    unit = {"images": "images/s", "tokens": "tokens/s"}
    print(f"\n{'part':8s} {'GPUs':>4s} {'per GPU':>12s} {'total':>12s} {'max wait':>9s} {'efficiency':>10s}")
    for part in args.parts.split(","):
        r = run[part]
        eff = f"{r['scaling_efficiency']:.0%}" if "scaling_efficiency" in r else "-"
        print(f"{part:8s} {world:4d} {r['per_gpu_mean']:12,.0f} {r['total']:12,.0f} {r['max_wait_fraction']:9.1%} "
              f"{eff:>10s}  ({unit[part]})")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
