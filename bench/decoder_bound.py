"""The decoders' own bound: ImageLoader alone (no model), images/s per hardware decoder share and DALI threads.

Each setting is a fresh ImageLoader (``DecodeOptions(hw_decoder_load=share, num_threads=threads)``, no step
hold: nothing trains beside it) whose batches the loop takes on the GPU (one tiny reduction each, on the
current stream; a wait for the GPU every 10 batches). ``--warmup`` batches untimed, then ``--batches``
timed. Beside it ``nvidia-smi dmon -s u`` samples the GPU each second: its ``sm`` column (the share of time a
kernel ran) and ``jpg`` (the hardware JPEG engines' busy share), averaged over each setting's timed window.
``--nvimg`` adds the probe feed of ``bench/nvimg_feed.py`` (the hardware decoder through nvImageCodec on a stream of
its own) for each option set listed, timed the same way.

    python bench/decoder_bound.py --out /tmp/d                       # 0.0 (12 and 14 threads) .. 1.0
    python bench/decoder_bound.py --settings 0.0/14,0.5/14 --out /tmp/d
    python bench/decoder_bound.py --settings "" --nvimg ,stream,gpu,hw0.5 --out /tmp/d   # the probe alone
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_SETTINGS = "0.0/12,0.0/14,0.25/14,0.5/14,0.75/14,0.75/8,1.0/8"


def parse_settings(text: str) -> list[tuple[float, int]]:
    """``"0.0/12,0.5/14"`` -> ``[(0.0, 12), (0.5, 14)]`` (hardware decoder share / DALI threads)."""
    out = []
    for item in filter(None, text.split(",")):
        share, _, threads = item.partition("/")
        try:
            out.append((float(share), int(threads)))
        except ValueError:
            raise ValueError(f"--settings: {item!r} is not share/threads (e.g. 0.5/14)") from None
        if not 0.0 <= out[-1][0] <= 1.0 or out[-1][1] < 1:
            raise ValueError(f"--settings: {item!r}: the share is in [0, 1], threads at least 1")
    return out


def dmon_means(lines: list[str], start: float, end: float) -> dict:
    """Mean of each ``nvidia-smi dmon -o T`` column over the samples stamped in [start, end] (epoch seconds,
    matched by the wall-clock time of day)."""
    header = None
    values: dict[str, list[float]] = {}
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "#Time":
            header = parts[1:]
            continue
        if parts[0].startswith("#") or header is None or len(parts) != len(header) + 1:
            continue
        stamp = _seconds_of_day(parts[0])
        if stamp is None or not _within(stamp, start, end):
            continue
        for name, v in zip(header, parts[1:]):
            try:
                values.setdefault(name, []).append(float(v))
            except ValueError:
                pass  # "-": not sampled
    return {k: round(sum(v) / len(v), 1) for k, v in values.items() if v and k != "gpu"}


def _seconds_of_day(text: str) -> int | None:
    try:
        h, m, s = (int(x) for x in text.split(":"))
    except ValueError:
        return None
    return 3600 * h + 60 * m + s


def _day(t: float) -> int:
    """Seconds into the local day at epoch time ``t`` (dmon stamps its samples with the local time of day)."""
    lt = time.localtime(t)
    return 3600 * lt.tm_hour + 60 * lt.tm_min + lt.tm_sec


def _within(stamp: int, start: float, end: float) -> bool:
    a, b = _day(start), _day(end)
    return a <= stamp <= b if a <= b else stamp >= a or stamp <= b


def measure(data: str, share: float, threads: int, *, batches: int, warmup: int, batch_size: int,
            image_size: int) -> dict:
    from loaders import DecodeOptions, ImageLoader

    loader = ImageLoader(data, batch_size=batch_size, image_size=image_size, device="cuda",
                         decode=DecodeOptions(hw_decoder_load=share, num_threads=threads))
    loader._hold.active = False  # nothing trains beside it: no step to wait for
    it = iter(_endless(loader))
    try:
        n, wall, t0 = timed(it, batches=batches, warmup=warmup)
    finally:
        close = getattr(it, "close", None)
        if close:
            close()
    return {"hw_decoder_load": share, "threads": threads, "images_per_s": round(n / wall, 1), "seconds": round(wall, 2),
            "t0": t0, "t1": t0 + wall, "decoder": loader.stats()["decoder"]}


def measure_nvimg(urls: list[str], spec: str, *, batches: int, warmup: int, batch_size: int, image_size: int) -> dict:
    """The probe feed ``nvimg@<spec>`` alone, timed as :func:`measure` times ImageLoader."""
    import torch

    from bench.nvimg_feed import NvImgFeed, nvimg_options

    feed = NvImgFeed(urls, batch_size=batch_size, image_size=image_size, device=torch.device("cuda"),
                     opts=nvimg_options(spec))
    try:
        n, wall, t0 = timed(feed, batches=batches, warmup=warmup)
    finally:
        feed.close()
    return {"nvimg": spec, "images_per_s": round(n / wall, 1), "seconds": round(wall, 2), "t0": t0, "t1": t0 + wall}


def timed(it, *, batches: int, warmup: int) -> tuple[int, float, float]:
    """``warmup`` batches untimed, then ``batches`` timed (a wait for the GPU every 10): (images, seconds, start)."""
    import torch

    sink = torch.zeros((), device="cuda")
    for _ in range(warmup):
        images, _ = next(it)
        sink += images[:, 0, 0, 0].float().sum()
    torch.cuda.synchronize()
    t0 = time.time()
    start = time.perf_counter()
    n = 0
    for i in range(batches):
        images, _ = next(it)
        sink += images[:, 0, 0, 0].float().sum()
        n += images.shape[0]
        if (i + 1) % 10 == 0:
            torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    return n, time.perf_counter() - start, t0


def _endless(loader):
    while True:
        yield from loader


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/tmp/datapipe-bench-images", help="image shards (made there if missing)")
    p.add_argument("--num-images", type=int, default=20000, help="JPEGs to make when --data is empty")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma list of share/threads (\"\": none)")
    p.add_argument("--nvimg", default=None,
                   help="comma list of the probe feed's option sets (bench/nvimg_feed.py; an empty item: no options)")
    p.add_argument("--batches", type=int, default=60, help="timed batches per setting")
    p.add_argument("--warmup", type=int, default=15, help="untimed batches per setting")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--out", required=True, help="folder for decoder_bound.json")
    args = p.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
    except ValueError as e:
        p.error(str(e))
    from bench.images import ensure_dataset

    data, _ = ensure_dataset(args.data, args.num_images, workers=os.cpu_count() or 1, per_shard=256)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "dmon.txt")
    with open(log_path, "w") as log:
        dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-o", "T", "-d", "1"], stdout=log,
                                stderr=subprocess.STDOUT)
    sizes = dict(batches=args.batches, warmup=args.warmup, batch_size=args.batch_size, image_size=args.image_size)
    runs = [(measure, (data, share, threads), {"hw_decoder_load": share, "threads": threads})
            for share, threads in settings]
    runs += [(measure_nvimg, (data, spec), {"nvimg": spec})
             for spec in ([] if args.nvimg is None else args.nvimg.split(","))]
    rows = []
    try:
        for fn, fn_args, what in runs:
            try:
                r = fn(*fn_args, **sizes)
            except Exception as e:  # noqa: BLE001  (one setting failing must not cost the others)
                r = {**what, "error": repr(e)[:300]}
            rows.append(r)
            print(f"[decoder_bound] {r}", file=sys.stderr, flush=True)
            time.sleep(1.2)  # the last dmon sample of this window lands
    finally:
        dmon.terminate()
        dmon.wait(timeout=10)
    with open(log_path) as f:
        lines = f.read().splitlines()
    for r in rows:
        if "t0" in r:
            r["dmon"] = dmon_means(lines, r.pop("t0"), r.pop("t1"))
    with open(os.path.join(args.out, "decoder_bound.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(r.get("nvimg", r.get("hw_decoder_load")), r.get("threads"), r.get("images_per_s"), r.get("dmon"),
              r.get("error", ""))
    return rows


if __name__ == "__main__":
    main()
