"""Device-wide syncs made behind ImageLoader, and the training thread's launch calls they block.

DALI's device memory pool frees memory in a worker thread that first calls
``cudaDeviceSynchronize``: it waits for every stream of the process, the training stream too.
This profiles ImageLoader alone while the main thread keeps the GPU busy (``--load`` matmuls
per batch on its own stream, as a training step would), for each way DALI's outputs can reach
torch: ``shared`` (the dynamic executor's outputs through DLPack, the default until this bench),
``copyout`` (the dynamic executor, outputs copied out), ``legacy`` (DALI's pipelined executor,
whose output buffers are recycled; copied out). Per batch: ``cudaDeviceSynchronize`` calls
outside the main thread and their time; the main thread's launch calls that took over 0.2 ms.

    python bench/dali_syncs.py --data /tmp/datapipe-bench-images --out bench/results
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import loaders.images.loader  # noqa: E402,F401 - before CUDA starts, as a training script would
import torch  # noqa: E402

from bench.ceiling import copied_outputs_row, dali_pipeline_row, image_loader  # noqa: E402
from bench.common import endless, table, write_result  # noqa: E402

MODES = {"shared": "imageloader", "copyout": "imageloader_copyout", "legacy": "imageloader_legacy"}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemcpyAsync", "cudaMemsetAsync")


def busy(a: torch.Tensor, n: int) -> None:
    """The consumer's GPU work for one batch: ``n`` chained matmuls."""
    for _ in range(n):
        a = a @ a
        a = a / a.norm()


def count_calls(events, batches: int) -> dict:
    """Per batch: device syncs outside the main thread, and the main thread's slow launch calls."""
    threads = collections.Counter(e.thread for e in events if e.name == "aten::mm")
    main_tid = threads.most_common(1)[0][0]  # the thread that ran the consumer's matmuls
    syncs = [e for e in events if e.name == "cudaDeviceSynchronize" and e.thread != main_tid]
    launches = [e for e in events if e.name in LAUNCHES and e.thread == main_tid]
    slow = [e for e in launches if e.time_range.elapsed_us() > 200]
    return {
        "device_syncs_per_batch": round(len(syncs) / batches, 2),
        "device_sync_ms_per_batch": round(sum(e.time_range.elapsed_us() for e in syncs) / 1e3 / batches, 3),
        "main_launches_per_batch": round(len(launches) / batches, 1),
        "main_slow_launches_per_batch": round(len(slow) / batches, 2),
        "main_slow_launch_ms_per_batch": round(sum(e.time_range.elapsed_us() for e in slow) / 1e3 / batches, 3),
    }


def probe(mode: str, urls, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(4096, 4096, device=args.device, dtype=torch.bfloat16)
    with dali_pipeline_row(MODES[mode]), copied_outputs_row(MODES[mode]):
        it = iter(endless(image_loader(urls, args)))
        try:
            for _ in range(6):
                busy(a, args.load)
                next(it)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.batches):
                    images, _labels = next(it)
                    busy(a, args.load)
                    images.float().mean()  # the consumer reads the batch
                    torch.cuda.current_stream().synchronize()
            wall = time.perf_counter() - t0
        finally:
            it.close()
    out = count_calls(prof.events(), args.batches)
    out["ms_per_batch"] = round(1e3 * wall / args.batches, 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/tmp/datapipe-bench-images")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--load", type=int, default=200, help="matmuls (4096^2 bf16) per batch on the main stream")
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("dali_syncs: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.images import ensure_dataset

    args.device = torch.device("cuda", 0)
    args.batch_size, args.image_size = 256, 224
    urls, _ = ensure_dataset(args.data, 20000, workers=os.cpu_count() or 1, per_shard=256)  # as bench/ceiling.py
    results = {"batches": args.batches, "load_matmuls": args.load, "modes": {}}
    for mode in args.modes.split(","):
        results["modes"][mode] = probe(mode, urls, args)
        print(f"    {mode}: {results['modes'][mode]}", file=sys.stderr, flush=True)
    path = write_result("dali_syncs", results, args.out)
    rows = [{"outputs": m, **r} for m, r in results["modes"].items()]
    print(table(rows, ["outputs", "device_syncs_per_batch", "device_sync_ms_per_batch", "main_slow_launches_per_batch",
                       "main_slow_launch_ms_per_batch", "ms_per_batch"]))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
