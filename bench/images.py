"""Images/s: ImageLoader against the baselines (torch + PIL, webdataset, hand-written DALI), then training.

Same shards (made by ``datapipe.tools.synthetic.make_image_dataset``, cached in ``--data``), same
augmentation (random-resized-crop, flip, normalise), same batch size; the baselines are
``datapipe.tools.bench.baselines``. Parts: (a) torch DataLoader + webdataset + PIL, (b)
webdataset.WebLoader, (c) hand-written DALI, (d) ``loaders.ImageLoader`` defaults; ``train``: a
ResNet-50 (random init, bf16 autocast, channels_last) step fed by each of ``--train-loaders``:
images/s and the fraction of wall time spent waiting for data. Writes ``bench/results/images.json``.

    python bench/images.py --device cuda          # the H200 run (20k images, batch 256)
    python bench/images.py --quick                # small CPU smoke run
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import sync, table, to_device, write_result  # noqa: E402
from datapipe.tools.bench import baselines  # noqa: E402
from datapipe.units import percentiles  # noqa: E402


# ---- data ---------------------------------------------------------------------------------------
def ensure_dataset(directory: str, num_images: int, *, workers: int, per_shard: int) -> tuple[list[str], dict]:
    from datapipe.tar.dali_index import default_index_path
    from datapipe.tools.synthetic import make_image_dataset

    manifest = os.path.join(directory, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        urls = sorted(glob.glob(os.path.join(directory, "shard-*.tar")))
        if m.get("num_samples") == num_images and all(os.path.exists(default_index_path(u)) for u in urls):
            return urls, {"cached": True}
        raise SystemExit(f"{directory} holds another dataset ({m.get('num_samples')} images): use another --data")
    info = make_image_dataset(directory, num_images=num_images, num_classes=1000, seed=0, shard_max_count=per_shard,
                              index=True, num_workers=workers)
    gen = {"cached": False, "seconds": round(info["seconds"], 2), "images_per_s": round(info["images_per_s"], 1),
           "workers": workers, "mean_kb": round(info["bytes"] / num_images / 1e3, 1)}
    print(f"generated {num_images} images in {info['seconds']:.1f} s ({info['images_per_s']:.0f} images/s, "
          f"{workers} processes, {gen['mean_kb']} KB each)", file=sys.stderr)
    return info["shards"], gen


# ---- the loaders ------------------------------------------------------------------------------------
def torch_dataloader(urls, args):
    """(a): torch DataLoader + webdataset + PIL (``args``: batch_size, image_size, workers, device)."""
    return baselines.torch_loader(urls, batch_size=args.batch_size, image_size=args.image_size, train=True,
                                  workers=args.workers, device=args.device)


def web_loader(urls, args):
    """(b): webdataset.WebLoader, batched in the workers."""
    return baselines.webdataset_loader(urls, batch_size=args.batch_size, image_size=args.image_size, train=True,
                                       workers=args.workers, device=args.device)


def dali_handwritten(urls, args):
    """(c): the hand-written DALI graph."""
    return baselines.DaliBaseline(urls, batch_size=args.batch_size, image_size=args.image_size, train=True,
                                  device=args.device, threads=args.dali_threads, hw_decoder_load=args.hw_decoder_load)


def image_loader(urls, args):
    """(d): ``loaders.ImageLoader`` with its defaults."""
    from loaders import ImageLoader

    return ImageLoader(urls, batch_size=args.batch_size, image_size=args.image_size, train=True, device=args.device)


LAST_LOADER: list = []  # the loader behind the last endless() (its stats() split the time in next())


def endless(make):
    """Epoch after epoch of a loader (set_epoch when it has one)."""
    loader = make()
    LAST_LOADER[:] = [loader]
    yield from baselines.endless(loader)


# ---- measurements -------------------------------------------------------------------------------
def throughput(batches, *, steps: int, warmup: int, device: str) -> dict:
    it = iter(batches)
    t_first = time.perf_counter()
    for _ in range(warmup):
        x, y = next(it)
    sync(device)
    start = time.perf_counter()
    n = 0
    for _ in range(steps):
        x, y = next(it)
        n += x.shape[0]
    sync(device)
    seconds = time.perf_counter() - start
    assert x.device.type == device
    return {"images_per_s": round(n / seconds, 1), "seconds": round(seconds, 2), "images": n,
            "startup_s": round(start - t_first, 2)}


def train(batches, *, steps: int, warmup: int, device: str, image_size: int) -> dict:
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    it = iter(batches)
    waits: list[float] = []
    n = 0
    for step in range(warmup + steps):
        if step == warmup:
            sync(device)
            waits, n, start = [], 0, time.perf_counter()
            before = loader_seconds()
        t0 = time.perf_counter()
        x, y = next(it)
        waits.append(time.perf_counter() - t0)
        x = x.to(memory_format=torch.channels_last)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":  # the step is done: time in next() is time the training stream had nothing to do
            torch.cuda.current_stream().synchronize()  # (not a device sync: the loader's own GPU work runs on)
        n += x.shape[0]
    seconds = time.perf_counter() - start
    ms = np.array(waits) * 1e3
    after = loader_seconds()
    split = {k: round((after[k] - before.get(k, 0.0)) / steps * 1e3, 2) for k in after}
    return {"images_per_s": round(n / seconds, 1), "data_wait_fraction": round(float(ms.sum()) / 1e3 / seconds, 3),
            "seconds": round(seconds, 2), "step_ms": round(seconds / steps * 1e3, 2),
            "wait_ms": {**percentiles(waits, qs=(50, 90), scale=1e3, digits=2), "max": round(float(ms.max()), 2)},
            "loader_ms_per_step": split}


def loader_seconds() -> dict:
    """ImageLoader's split of its time in next() (read / dali / copy), when the loader is one."""
    loader = LAST_LOADER[0] if LAST_LOADER else None
    return dict(loader.stats().get("seconds", {})) if hasattr(loader, "stats") else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--data", default="/tmp/datapipe-bench-images", help="dataset cache directory")
    p.add_argument("--num-images", type=int, default=20000)
    p.add_argument("--per-shard", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=16, help="DataLoader workers for (a) and (b)")
    p.add_argument("--dali-threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--hw-decoder-load", type=float, default=0.75, help="hand-written DALI's hardware decoder share")
    p.add_argument("--steps", type=int, default=60, help="timed batches per loader")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--only", default="a,b,c,d,train", help="comma list of parts to run (a,b,c,d,train)")
    p.add_argument("--train-loaders", default="a,c,d", help="loaders that feed the training test")
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run (no training part)")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.device = "cpu"
        args.num_images, args.per_shard, args.batch_size, args.image_size = 96, 16, 16, 64
        args.workers, args.dali_threads, args.steps, args.warmup = 2, 2, 3, 1
        args.data = args.data.rstrip("/") + "-quick"
        args.only = ",".join(x for x in args.only.split(",") if x != "train")
    parts = set(args.only.split(","))

    urls, generation = ensure_dataset(args.data, args.num_images, workers=args.gen_workers, per_shard=args.per_shard)
    results: dict = {"config": {k: v for k, v in vars(args).items()}, "generation": generation, "loaders": {},
                     "training": {}}
    candidates = {
        "a": ("torch DataLoader + webdataset + PIL", lambda: to_device(endless(lambda: torch_dataloader(urls, args)),
                                                                       args.device)),
        "b": ("webdataset.WebLoader + PIL", lambda: to_device(endless(lambda: web_loader(urls, args)), args.device)),
        "c": ("hand-written DALI (readers.webdataset)", lambda: iter(dali_handwritten(urls, args))),
        "d": ("loaders.ImageLoader (defaults)", lambda: endless(lambda: image_loader(urls, args))),
    }
    for key, (name, make) in candidates.items():
        if key not in parts:
            continue
        print(f"[{key}] {name} ...", file=sys.stderr)
        LAST_LOADER.clear()
        try:
            batches = make()
            r = throughput(batches, steps=args.steps, warmup=args.warmup, device=args.device)
            batches.close()
        except Exception as e:  # one broken candidate must not cost the others' numbers
            traceback.print_exc()
            results["loaders"][key] = {"name": name, "error": repr(e)[:500], "images_per_s": 0.0}
            continue
        results["loaders"][key] = {"name": name, **r}
        print(f"    {r['images_per_s']} images/s", file=sys.stderr)

    if "train" in parts and args.device == "cuda":
        torch.backends.cudnn.benchmark = True
        for key in args.train_loaders.split(","):
            name, make = candidates[key]
            print(f"[train/{key}] ResNet-50 fed by {name} ...", file=sys.stderr)
            LAST_LOADER.clear()
            try:
                batches = make()
                r = train(batches, steps=args.train_steps, warmup=args.warmup, device=args.device,
                          image_size=args.image_size)
                batches.close()
            except Exception as e:
                traceback.print_exc()
                results["training"][key] = {"name": name, "error": repr(e)[:500]}
                continue
            results["training"][key] = {"name": name, **r}
            print(f"    {r['images_per_s']} images/s, data wait {r['data_wait_fraction']:.1%} "
                  f"(per step {r['wait_ms']}, loader {r['loader_ms_per_step']})", file=sys.stderr)

    path = write_result("images", results, args.out)
    rows = [{"loader": f"({k}) {v['name']}", "images/s": v["images_per_s"]} for k, v in results["loaders"].items()]
    print(table(rows, ["loader", "images/s"]))
    if results["training"]:
        rows = [{"fed by": f"({k}) {v['name']}", "images/s": v["images_per_s"],
                 "data wait": f"{v['data_wait_fraction']:.1%}", "wait p50/p90 ms": "{p50}/{p90}".format(**v["wait_ms"])}
                for k, v in results["training"].items() if "error" not in v]
        print()
        print(table(rows, ["fed by", "images/s", "data wait", "wait p50/p90 ms"]))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
