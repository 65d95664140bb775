"""The peers benchmark's ``decode_own`` row: a system's own documented image decoder on the CPU, beside the
``decode`` row where every system runs the same PIL steps in its workers.

Only datapipe has one among the systems measured: :class:`loaders.ImageLoader` with ``device="cpu"`` (DALI's CPU
operators: the random-resized-crop fused into decoding, so only the crop's region of a JPEG is decoded, then resize,
flip and normalise to float32 CHW, as :class:`~datapipe.tools.bench.baselines.PilTrain` gives) in
``decode_workers`` DALI threads of one process, over the shards ``datapipe shard`` wrote, shuffle on.
"""
from __future__ import annotations

import time

__all__ = ["OWN_DECODERS", "describe_own", "row_decode_own"]

OWN_DECODERS = ("datapipe",)


def describe_own(system: str, threads: int) -> str:
    """What the ``decode_own`` row of ``system`` did."""
    if system != "datapipe":
        raise ValueError(f"{system} has no decoder of its own here: only {', '.join(OWN_DECODERS)}")
    return (f"loaders.ImageLoader(device='cpu'): DALI's CPU decoder with the random-resized-crop fused into decoding, "
            f"resize, flip, normalise; {threads} DALI threads, one process; ShardStream(shuffle=True)")


def row_decode_own(system: str, data: str, *, batch_size: int, workers: int, seed: int, image_size: int,
                   cache_dir: str | None, seconds: float | None = None) -> dict:
    """The first batch's time, then the steady rate over the next ``seconds`` (or the epoch), as the ``decode`` row
    times (the batches DALI made ahead by the first one are left out of the steady window)."""
    from datapipe import ShardStream
    from datapipe.tools.bench.baselines import close
    from datapipe.tools.bench.peer_readers import steady_rate
    from loaders import ImageLoader
    from loaders.images.options import DecodeOptions, ReadOptions

    describe_own(system, workers)  # only a system that has one
    t0 = time.perf_counter()
    stream = ShardStream(data, shuffle=True, shuffle_buffer=2000, seed=seed)
    depth = 2
    loader = ImageLoader(stream, batch_size=batch_size, image_size=image_size, device="cpu",
                         decode=DecodeOptions(num_threads=max(1, workers)),
                         read=ReadOptions(prefetch_queue_depth=depth))
    it = iter(loader)
    try:
        images, _ = next(it)
        first = time.perf_counter() - t0
        steady = steady_rate(it, skip=depth, seconds=seconds, count=lambda batch: len(batch[1]))
    finally:
        close(it)
    return {"first_batch_s": round(first, 3), **steady, "batch_shape": list(images.shape),
            "did": describe_own(system, workers)}
