"""Where a loader's ``next()`` time goes when the batch is already made (a diagnostic for bench/ceiling.py).

The ceiling benchmark's loaded loops spend 0.3-0.7 ms per step in ``next()`` although the producer
thread is ahead. This times each ``next()`` of TokenLoader (small causal LM step) and ImageLoader
(ResNet-50 step) in the same loop as bench/ceiling.py, with the producer handoff (event wait +
record_stream) timed apart from the rest (queue, generator layers, freeing the previous batch),
with variants (``--variants``; ``--rounds`` repeats them interleaved): ``hostready``: ``ImageLoader(ready="host")``
(the producer thread waits for each batch's GPU work and records the retire fences, so ``next()``
makes no CUDA call), ``checkedready``: ``ready="checked"``, ``free_in_consumer``: the training thread frees handed-out batches itself (as
before ``datapipe.device.handoff.Retirer``), ``switch``: ``sys.setswitchinterval(1e-4)`` (is it
the GIL handoff?), ``free_first``: the previous batch dropped before ``next()``.

    python bench/next_latency.py --out bench/results     # on the GPU machine
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import retiring, write_result  # noqa: E402
from datapipe.device import handoff  # noqa: E402

PARTS = {"handoff": [], "queued": []}
_NEXT = handoff.Producer.__next__


def _timed_next(self):
    """Producer.__next__ with its handoff (event wait + record_stream) timed and the queue length noted."""
    inner = self._handoff
    if inner is not None and not getattr(inner, "timed", False):
        def timed(item):
            t0 = time.perf_counter()
            out = inner(item)
            PARTS["handoff"].append(time.perf_counter() - t0)
            return out

        timed.timed = True
        self._handoff = timed
    PARTS["queued"].append(self._queue.qsize())
    return _NEXT(self)


def run(loader, step, *, steps: int, warmup: int, free_first: bool) -> dict:
    for v in PARTS.values():
        v.clear()
    it = iter(loader)
    waits = []
    batch = None
    for i in range(warmup + steps):
        if i == warmup:
            waits.clear()
            for v in PARTS.values():
                v.clear()
            start = time.perf_counter()
        if free_first:
            batch = None
        t0 = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t0)
        step(batch)
        torch.cuda.current_stream().synchronize()
    wall = time.perf_counter() - start
    close = getattr(it, "close", None)
    if close:
        close()
    ms = lambda xs: round(float(np.median(xs)) * 1e3, 3) if len(xs) else None  # noqa: E731
    return {"step_ms": round(wall / steps * 1e3, 2), "next_ms_p50": ms(waits),
            "next_ms_p90": round(float(np.percentile(waits, 90)) * 1e3, 3),
            "handoff_ms_p50": ms(PARTS["handoff"]),
            "queued_min": int(min(PARTS["queued"])) if PARTS["queued"] else None}


def main(argv=None) -> dict:
    from bench.ceiling import ImageStep, TokenStep
    from bench.scaling import ensure_tokens
    from loaders import ImageLoader, TokenLoader

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/datapipe-bench-images")
    ap.add_argument("--tokens-dir", default="/tmp/datapipe-scaling-tokens")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--variants", default="default,free_in_consumer,free_first,switch",
                    help="comma-separated: default, hostready, checkedready, free_in_consumer, free_first, switch")
    ap.add_argument("--loaders", default="tokens,images", help="comma-separated: tokens, images")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the variants, interleaved (keys get _r2, _r3, ...)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    handoff.Producer.__next__ = _timed_next
    results = {}
    urls = ensure_tokens(args.tokens_dir, 20000, 0)
    tstep = TokenStep(device, 4096)
    from bench.images import ensure_dataset

    images, _ = ensure_dataset(args.data, 20000, workers=os.cpu_count() or 1, per_shard=256)
    torch.backends.cudnn.benchmark = True
    istep = ImageStep(device, "resnet50")
    default_switch = sys.getswitchinterval()
    chosen = args.loaders.split(",")
    for rnd, variant in ((r, v) for r in range(1, args.rounds + 1) for v in args.variants.split(",")):
        sys.setswitchinterval(1e-4 if variant == "switch" else default_switch)
        ready = dict(ready=variant[:-len("ready")]) if variant in ("hostready", "checkedready") else {}
        for name, make, step in (
            ("tokens", lambda: TokenLoader(urls, seq_len=4096, batch_size=4, device=device), tstep),
            ("images", lambda: ImageLoader(images, batch_size=256, device=device, **ready), istep),
        ):
            if name not in chosen:
                continue
            key = f"{name}_{variant}" + (f"_r{rnd}" if rnd > 1 else "")
            with retiring(variant != "free_in_consumer"):  # free_in_consumer: as before handoff.Retirer
                results[key] = r = run(make(), step, steps=args.steps, warmup=args.warmup,
                                       free_first=variant == "free_first")
            print(f"{key}: {r}", file=sys.stderr, flush=True)
    sys.setswitchinterval(default_switch)
    write_result("next_latency", {"config": vars(args), "results": results}, args.out)
    return results


if __name__ == "__main__":
    main()
