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
    host_share=None,
):
    """Build (not run) a DALI pipeline whose outputs are ``(images,)`` or, with ``reader``, ``(images, labels)``.

    ``mean``/``std`` are in 0..255 pixel units. ``source=None`` and ``reader=None`` makes an
    external source named ``"jpegs"`` to be fed with ``pipe.feed_input`` / ``pipe.run(jpegs=...)``.
    ``reader`` holds ``fn.readers.webdataset`` arguments (``paths``, ``index_paths``, ``ext``,
    ``random_shuffle``, ``initial_fill``, ``shard_id``, ``num_shards``, ...); its second output
    (the raw label bytes; zero-padded to the batch's longest with ``pad_labels``) is returned as
    the pipeline's second output. ``source_info`` (with ``reader``) adds a third, CPU output: each
    sample's ``"<tar path>:<data offset>:<member name>"`` (DALI's ``source_info`` property of the
    image read), zero-padded to one uint8 array per batch. ``host_share`` (a
    ``loaders.images.host_share.HostShare``) splits each batch: the images its predicates mark are
    decoded and resized on the CPU (then copied to the GPU), the rest as ``device`` says; DALI's
    conditional execution merges them back in order.
    """
    from nvidia.dali import pipeline_def

    gpu = device == "cuda"
    pipeline_args = dict(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id if gpu else None,
        seed=seed,
        prefetch_queue_depth=prefetch_queue_depth,
        exec_async=True,
        exec_pipelined=True,
        enable_checkpointing=enable_checkpointing or checkpoint is not None,
        **({"checkpoint": checkpoint} if checkpoint is not None else {}),
    )
    graph = _Graph(
        batch_size=batch_size, image_size=image_size, train=train, gpu=gpu, dtype=dtype, layout=layout,
        mean=mean, std=std, hw_decoder_load=hw_decoder_load, random_area=random_area,
        random_aspect_ratio=random_aspect_ratio, resize_size=resize_size, antialias=antialias,
    )
    split = host_share is not None
    return pipeline_def(enable_conditionals=split)(graph.outputs)(
        source=source, reader=reader, pad_labels=pad_labels, source_info=source_info, host_share=host_share,
        **pipeline_args)


class _Graph:
    """The operators of the pipeline, with the options they share; ``outputs`` builds the graph."""

    def __init__(self, *, batch_size, image_size, train, gpu, dtype, layout, mean, std, hw_decoder_load,
                 random_area, random_aspect_ratio, resize_size, antialias):
        self.batch_size, self.image_size, self.train, self.gpu = batch_size, image_size, train, gpu
        self.dtype, self.layout, self.mean, self.std = dtype, layout, mean, std
        self.hw_decoder_load, self.random_area, self.random_aspect_ratio = hw_decoder_load, random_area, random_aspect_ratio
        self.resize_size, self.antialias = resize_size, antialias

    def outputs(self, source, reader, pad_labels, source_info, host_share):
        """(Inside ``pipeline_def``) encoded images -> decoded, resized, flipped and normalised."""
        from nvidia.dali import fn, types

        labels = info = on_cpu = None
        if reader is not None:
            jpegs, labels = fn.readers.webdataset(name="Reader", **reader)
            if source_info:  # which samples a batch holds (the elastic resume's record); CPU only
                info = fn.pad(fn.get_property(jpegs, key="source_info"), fill_value=0)
            if host_share is not None:
                on_cpu = fn.external_source(source=host_share.predicates, batch=True, dtype=types.BOOL, ndim=0,
                                            name="on_cpu")
        elif source is not None:
            if host_share is not None:  # one predicate per image actually fed (the last batch may be short)
                jpegs, on_cpu = fn.external_source(source=_with_predicates(source, host_share), num_outputs=2,
                                                   batch=True, dtype=[types.UINT8, types.BOOL], ndim=[1, 0])
            else:
                jpegs = fn.external_source(source=source, name="jpegs", batch=True, dtype=types.UINT8,
                                           ndim=1, no_copy=True)
        else:
            jpegs = fn.external_source(name="jpegs", batch=True, dtype=types.UINT8, ndim=1)
        if on_cpu is not None:
            if on_cpu:  # DALI's conditional: only this batch's CPU images run here, order kept on merge
                images = self.decoded(jpegs, on_gpu=False)
                if self.gpu:
                    images = images.gpu()
            else:
                images = self.decoded(jpegs, on_gpu=self.gpu)
        else:
            images = self.decoded(jpegs, on_gpu=self.gpu)
        images = self.normalised(images)
        if labels is None:
            return images
        if pad_labels:  # one dense (batch, longest) uint8 array instead of a ragged batch
            labels = fn.pad(labels, fill_value=0)
        return (images, labels, info) if info is not None else (images, labels)

    def decoded(self, jpegs, *, on_gpu: bool):
        """Decode (train: random-resized-crop ROI) and resize to uint8 HWC, on the GPU or the CPU."""
        from nvidia.dali import fn, types

        decoder_device, op_device = ("mixed", "gpu") if on_gpu else ("cpu", "cpu")
        decoder_args = {}
        if on_gpu:
            decoder_args = dict(device_memory_padding=_DEVICE_MEMORY_PADDING, host_memory_padding=_HOST_MEMORY_PADDING,
                                hw_decoder_load=self.hw_decoder_load)
        if self.train:
            if on_gpu:
                decoder_args.update(preallocate_width_hint=_HW_PREALLOC_WIDTH,
                                    preallocate_height_hint=_HW_PREALLOC_HEIGHT)
            images = fn.decoders.image_random_crop(
                jpegs, device=decoder_device, output_type=types.RGB,
                random_area=list(self.random_area), random_aspect_ratio=list(self.random_aspect_ratio),
                num_attempts=100, **decoder_args,
            )
            return fn.resize(images, device=op_device, resize_x=self.image_size, resize_y=self.image_size,
                             interp_type=types.INTERP_LINEAR, antialias=self.antialias)
        images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB, **decoder_args)
        return fn.resize(images, device=op_device, resize_shorter=self.resize_size or self.image_size,
                         interp_type=types.INTERP_LINEAR, antialias=self.antialias)

    def normalised(self, images):
        """Center crop to the output size, flip (train), normalise, cast and lay out."""
        from nvidia.dali import fn

        mirror = fn.random.coin_flip(probability=0.5) if self.train else 0
        if self.dtype == "uint8":  # raw pixels: no normalisation
            norm = dict(mean=[0.0], std=[1.0])
        else:
            norm = dict(mean=list(self.mean), std=list(self.std))
        return fn.crop_mirror_normalize(
            images, device="gpu" if self.gpu else "cpu", dtype=dali_dtype(self.dtype),
            output_layout="CHW" if self.layout == "NCHW" else "HWC",
            crop=(self.image_size, self.image_size), crop_pos_x=0.5, crop_pos_y=0.5, rounding="truncate",
            mirror=mirror, **norm,
        )


def _with_predicates(source: Callable, host_share):
    """An external source giving ``(encoded images, HostShare predicates)`` for each batch of ``source``."""

    def both():
        jpegs = source()
        return jpegs, host_share.predicates_for(len(jpegs))

    return both
