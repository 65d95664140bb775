"""The DALI graph behind ``ImageLoader``: encoded images -> decode (+ random crop) -> resize -> flip/normalise.

Encoded bytes come either from an ``fn.external_source`` (``source`` callable, batch mode, uint8
1-D arrays) or from DALI's own ``fn.readers.webdataset`` (``reader`` dict). On ``device="cuda"``
decoding is ``mixed`` (nvImageCodec with the hardware JPEG decoder where the GPU has one) and the
rest runs on the GPU; on ``device="cpu"`` every operator runs on the CPU (``device_id=None``).
"""
from __future__ import annotations

from typing import Callable, Sequence

# DALI's own RN50 example values: preallocate the nvJPEG buffers so large images don't reallocate.
_DEVICE_MEMORY_PADDING = 211025920
_HOST_MEMORY_PADDING = 140544512
_HW_PREALLOC_WIDTH = 5980
_HW_PREALLOC_HEIGHT = 6430


def dali_dtype(name: str):
    """DALI output type for ``crop_mirror_normalize``: float32, float16 or uint8 (bfloat16 is cast in torch)."""
    from nvidia.dali import types

    table = {"float32": types.FLOAT, "bfloat16": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}
    return table[name]


def run_pipeline(pipe, stream, **inputs):
    """``pipe.run``, its outputs bound to ``stream`` (the default executor); DALI's legacy executor takes
    no output stream: its outputs come host-synchronised."""
    return pipe.run(stream if pipe.exec_dynamic else None, **inputs)


def failure_text(error: BaseException) -> str:
    """The line of a DALI pipeline error that says what failed (after DALI's "encountered:"), not its traceback."""
    lines = [m.strip() for m in str(error).splitlines() if m.strip()]
    after = lines[lines.index("encountered:") + 1:] if "encountered:" in lines else lines
    useful = [m for m in after if "pipeline object is no longer valid" not in m and "Critical error" not in m]
    return (useful or lines or [""])[0][:200]


def build_image_pipeline(
    *,
    batch_size: int,
    image_size: int,
    train: bool,
    device: str,
    device_id: int | None,
    dtype: str = "float32",
    layout: str = "NCHW",
    mean: Sequence[float] = (0.0, 0.0, 0.0),
    std: Sequence[float] = (1.0, 1.0, 1.0),
    seed: int = 0,
    num_threads: int = 4,
    prefetch_queue_depth: int = 2,
    hw_decoder_load: float = 0.75,
    random_area: Sequence[float] = (0.08, 1.0),
    random_aspect_ratio: Sequence[float] = (3 / 4, 4 / 3),
    resize_size: int | None = None,
    source: Callable | None = None,
    reader: dict | None = None,
    enable_checkpointing: bool = False,
    pad_labels: bool = False,
    checkpoint: str | None = None,
    antialias: bool = True,
    source_info: bool = False,
    exec_dynamic: bool | None = None,
):
    """Build (not run) a DALI pipeline whose outputs are ``(images,)`` or, with ``reader``, ``(images, labels)``.

    ``mean``/``std`` are in 0..255 pixel units. ``source=None`` and ``reader=None`` makes an
    external source named ``"jpegs"`` to be fed with ``pipe.feed_input`` / ``pipe.run(jpegs=...)``.
    ``reader`` holds ``fn.readers.webdataset`` arguments (``paths``, ``index_paths``, ``ext``,
    ``random_shuffle``, ``initial_fill``, ``shard_id``, ``num_shards``, ...); its second output
    (the raw label bytes; zero-padded to the batch's longest with ``pad_labels``) is returned as
    the pipeline's second output. ``source_info`` (with ``reader``) adds a third, CPU output: each
    sample's ``"<tar path>:<data offset>:<member name>"`` (DALI's ``source_info`` property of the
    image read), zero-padded to one uint8 array per batch.
    """
    from datapipe.extras import require

    require("nvidia.dali", what="ImageLoader (DALI decoding)")
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    gpu = device == "cuda"
    decoder_device = "mixed" if gpu else "cpu"
    op_device = "gpu" if gpu else "cpu"
    pipe = Pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id if gpu else None,
        seed=seed,
        prefetch_queue_depth=prefetch_queue_depth,
        exec_async=True,
        exec_pipelined=True,
        exec_dynamic=exec_dynamic,
        enable_checkpointing=enable_checkpointing or checkpoint is not None,
        **({"checkpoint": checkpoint} if checkpoint is not None else {}),
    )
    decoder_args = {}
    if gpu:
        decoder_args = dict(
            device_memory_padding=_DEVICE_MEMORY_PADDING,
            host_memory_padding=_HOST_MEMORY_PADDING,
            hw_decoder_load=hw_decoder_load,
        )
    out_layout = "CHW" if layout == "NCHW" else "HWC"
    with pipe:
        labels = info = None
        if reader is not None:
            jpegs, labels = fn.readers.webdataset(name="Reader", **reader)
            if source_info:  # which samples a batch holds (the elastic resume's record); CPU only
                info = fn.pad(fn.get_property(jpegs, key="source_info"), fill_value=0)
        elif source is not None:
            jpegs = fn.external_source(source=source, name="jpegs", batch=True, dtype=types.UINT8,
                                       ndim=1, no_copy=True)
        else:
            jpegs = fn.external_source(name="jpegs", batch=True, dtype=types.UINT8, ndim=1)
        if train:
            if gpu:
                decoder_args.update(preallocate_width_hint=_HW_PREALLOC_WIDTH,
                                    preallocate_height_hint=_HW_PREALLOC_HEIGHT)
            images = fn.decoders.image_random_crop(
                jpegs, device=decoder_device, output_type=types.RGB,
                random_area=list(random_area), random_aspect_ratio=list(random_aspect_ratio),
                num_attempts=100, **decoder_args,
            )
            images = fn.resize(images, device=op_device, resize_x=image_size, resize_y=image_size,
                               interp_type=types.INTERP_LINEAR, antialias=antialias)
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB, **decoder_args)
            images = fn.resize(images, device=op_device, resize_shorter=resize_size or image_size,
                               interp_type=types.INTERP_LINEAR, antialias=antialias)
            mirror = 0
        out_dtype = dali_dtype(dtype)
        if dtype == "uint8":  # raw pixels: no normalisation
            norm = dict(mean=[0.0], std=[1.0])
        else:
            norm = dict(mean=list(mean), std=list(std))
        images = fn.crop_mirror_normalize(
            images, device=op_device, dtype=out_dtype, output_layout=out_layout,
            crop=(image_size, image_size), crop_pos_x=0.5, crop_pos_y=0.5, rounding="truncate", mirror=mirror,
            **norm,
        )
        if labels is not None:
            if pad_labels:  # one dense (batch, longest) uint8 array instead of a ragged batch
                labels = fn.pad(labels, fill_value=0)
            pipe.set_outputs(images, labels, *([info] if info is not None else []))
        else:
            pipe.set_outputs(images)
    return pipe
