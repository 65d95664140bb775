"""Image loading: torch DataLoader + webdataset + PIL vs WebLoader vs hand-written DALI vs ImageLoader.

Same shards (made by datapipe.make_image_dataset, cached in --data), same augmentation
(random-resized-crop, flip, normalise), same batch size. Then the starvation test: a ResNet-50
(random init, bf16 autocast, channels_last) training step fed by the PIL DataLoader and by
ImageLoader: images/s and the fraction of wall time spent waiting for data.
Writes bench/results/images.json.

    python bench/images.py --device cuda [--num-images 20000 --steps 60 --train-steps 150 --data DIR]
    python bench/images.py --quick          # small CPU smoke run
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.common import sync, table, to_device, write_result  # noqa: E402
from datapipe.units import percentiles  # noqa: E402

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


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


# ---- (a) / (b): webdataset + PIL ----------------------------------------------------------------
class PilTrainTransform:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize (PIL fallback without torchvision)."""

    def __init__(self, size: int):
        self.size = size
        try:
            import torchvision.transforms as T

            self.tv = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                                 T.Normalize(MEAN, STD)])
        except ImportError:
            self.tv = None

    def __call__(self, img):
        if self.tv is not None:
            return self.tv(img)
        import random

        from PIL import Image

        w, h = img.size
        for _ in range(10):
            area = w * h * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                break
        else:
            cw, ch, x, y = w, h, 0, 0
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        a = (np.asarray(img, dtype=np.float32) / 255 - MEAN) / STD
        return torch.from_numpy(a.transpose(2, 0, 1).astype(np.float32))


def pil_webdataset(urls, image_size, *, batch_size=None):
    """The baselines' pipeline: shard shuffle, a 1000-sample buffer, PIL decode, torchvision train transform."""
    import webdataset as wds

    ds = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.single_node_only, empty_check=False)
          .shuffle(1000).decode("pil").to_tuple("jpg", "cls").map_tuple(PilTrainTransform(image_size), int))
    if batch_size:
        ds = ds.batched(batch_size, partial=False)
    return ds


def torch_dataloader(urls, args):
    ds = pil_webdataset(urls, args.image_size)
    return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                                       pin_memory=args.device == "cuda", drop_last=True, persistent_workers=False,
                                       prefetch_factor=2 if args.workers else None)


def web_loader(urls, args):
    import webdataset as wds

    ds = pil_webdataset(urls, args.image_size, batch_size=args.batch_size)
    return wds.WebLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=args.device == "cuda",
                         prefetch_factor=2 if args.workers else None)


# ---- (c): hand-written DALI ---------------------------------------------------------------------
def dali_handwritten(urls, args):
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from datapipe.tar.dali_index import default_index_path

    gpu = args.device == "cuda"
    pipe = Pipeline(batch_size=args.batch_size, num_threads=args.dali_threads, device_id=0 if gpu else None,
                    seed=0, prefetch_queue_depth=2)
    with pipe:
        jpg, cls = fn.readers.webdataset(paths=urls, index_paths=[default_index_path(u) for u in urls],
                                         ext=["jpg", "cls"], random_shuffle=True, initial_fill=2000, name="Reader")
        extra = dict(hw_decoder_load=args.hw_decoder_load, device_memory_padding=211025920,
                     host_memory_padding=140544512, preallocate_width_hint=5980,
                     preallocate_height_hint=6430) if gpu else {}
        images = fn.decoders.image_random_crop(jpg, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                               num_attempts=100, **extra)
        images = fn.resize(images, device="gpu" if gpu else "cpu", resize_x=args.image_size,
                           resize_y=args.image_size, interp_type=types.INTERP_LINEAR, antialias=True)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          crop=(args.image_size, args.image_size),
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=fn.random.coin_flip(probability=0.5))
        pipe.set_outputs(images, cls)
    pipe.build()
    device = torch.device("cuda" if gpu else "cpu")

    def batches():
        while True:
            stream = torch.cuda.current_stream() if gpu else None
            imgs, labels = pipe.run(stream) if gpu else pipe.run()
            t = imgs.as_tensor()
            x = torch.empty(t.shape(), dtype=torch.float32, device=device)
            feed_ndarray(t, x, cuda_stream=stream)
            y = torch.tensor([int(np.asarray(labels.at(i)).tobytes()) for i in range(len(labels))])
            yield x, y.to(device, non_blocking=True)

    return batches()


# ---- (d): ImageLoader ---------------------------------------------------------------------------
def image_loader(urls, args, reader="auto", read_workers=0, depth=2, hw_decoder_load=None):
    from loaders import ImageLoader

    hw = args.hw_decoder_load if hw_decoder_load is None else hw_decoder_load
    return ImageLoader(urls, batch_size=args.batch_size, image_size=args.image_size, train=True,
                       device=args.device, num_threads=args.dali_threads, hw_decoder_load=hw,
                       reader=reader, index_dir=None, read_workers=read_workers, prefetch_queue_depth=depth)


LAST_LOADER: list = []  # the loader behind the last endless() (its stats() split the time in next())


def endless(make):
    """Epoch after epoch of a loader (set_epoch when it has one)."""
    loader = make()
    LAST_LOADER[:] = [loader]
    yield from common.endless(loader)


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--data", default="/tmp/datapipe-bench-images", help="dataset cache directory")
    p.add_argument("--num-images", type=int, default=20000)
    p.add_argument("--per-shard", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=16, help="DataLoader workers for (a) and (b)")
    p.add_argument("--dali-threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--hw-decoder-load", type=float, default=0.75)
    p.add_argument("--steps", type=int, default=60, help="timed batches per loader")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--read-workers", type=int, default=4, help="reader processes of the d_workers variant")
    p.add_argument("--only", default="a,b,c,d,d_stream,train", help="comma list of parts to run")
    p.add_argument("--train-loaders", default="a,c,d,d_stream", help="loaders that feed the training test")
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
        "c": ("hand-written DALI (readers.webdataset)", lambda: dali_handwritten(urls, args)),
        "d": ("loaders.ImageLoader (defaults: reader=auto -> DALI's reader)",
              lambda: endless(lambda: image_loader(urls, args))),
        "d_stream": ("loaders.ImageLoader (reader=stream)", lambda: endless(lambda: image_loader(urls, args, "stream"))),
        "d_dali": ("loaders.ImageLoader (reader=dali)", lambda: endless(lambda: image_loader(urls, args, "dali"))),
        "d_deep": ("loaders.ImageLoader (reader=stream, prefetch_queue_depth=4)",
                   lambda: endless(lambda: image_loader(urls, args, "stream", depth=4))),
        "d_dali_deep": ("loaders.ImageLoader (reader=dali, prefetch_queue_depth=4)",
                        lambda: endless(lambda: image_loader(urls, args, "dali", depth=4))),
        "d_hw": ("loaders.ImageLoader (reader=stream, hw_decoder_load=1.0)",
                 lambda: endless(lambda: image_loader(urls, args, "stream", hw_decoder_load=1.0))),
        "d_workers": (f"loaders.ImageLoader (reader=stream, read_workers={args.read_workers})",
                      lambda: endless(lambda: image_loader(urls, args, "stream", read_workers=args.read_workers))),
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
