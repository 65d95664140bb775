"""The peers benchmark's readers: the image folder every system writes from, and each system's documented
loader over its own format (:func:`open_loader`), handing out ``(keys, values, labels)`` batches of raw bytes
or of decoded, cropped images; :func:`describe` says what each one does. :mod:`datapipe.tools.bench.peers`
times them."""
from __future__ import annotations

import os
import pickle
import random
import time
from typing import Callable

SYSTEMS = ("torch", "webdataset", "datapipe", "litdata", "mosaicml", "spdl", "grain", "energon")
ENERGON_SHUFFLE = 1000  # Energon's sample shuffle buffer (webdataset's here too)
ENERGON_SEQUENCE = 100  # Energon's max_samples_per_sequence (its quickstart's)


def list_images(folder: str) -> list[tuple[str, str, int]]:
    """``(path, key, label)`` per image, labels by sorted class folder (as ``datapipe shard`` numbers them)."""
    if not os.path.isdir(folder):
        return []
    classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    out = []
    for label, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(folder, c))):
            if name.lower().endswith((".jpg", ".jpeg")):
                out.append((os.path.join(folder, c, name), f"{c}/{os.path.splitext(name)[0]}", label))
    return out


def read_item(item: tuple[str, str, int]) -> dict:
    path, key, label = item
    with open(path, "rb") as f:
        return {"key": key, "image": f.read(), "cls": label}


# ---- each system's loader ------------------------------------------------------------------------------------------------
class FilesDataset:
    """torch's map-style way over loose files: ``(key, bytes, label)`` or, with ``fn``, ``fn`` of that."""

    def __init__(self, folder: str, fn: Callable | None = None):
        self.items, self.fn = list_images(folder), fn

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s = read_item(self.items[i])
        out = (s["key"], s["image"], s["cls"])
        return self.fn(out) if self.fn else out


def raw_collate(samples: list) -> tuple[list, list, list]:
    """A batch of ``(key, value, label)`` samples as three lists (values stay bytes or become tensors as given)."""
    keys, values, labels = zip(*samples)
    return list(keys), list(values), list(labels)


class Decode:
    """``(key, bytes, label)`` -> ``(key, image tensor, label)`` with PIL and :class:`PilTrain`."""

    def __init__(self, size: int):
        from datapipe.tools.bench.baselines import PilTrain

        self.transform = PilTrain(size)

    def __call__(self, sample):
        from datapipe.tools.bench.baselines import decode_image

        key, data, label = sample
        return key, self.transform(decode_image(data)), label


def _wds_tuple(s: dict):
    return s["__key__"], s["jpg"], int(s["cls"])


def _stream_tuple(s: dict):
    return s["__key__"], bytes(s["jpg"]), int(bytes(s["cls"]))


def _dict_tuple(s: dict):
    return s["key"], s["image"], int(s["cls"])


def _identity(x):
    return x


class _Then:
    """``second(first(x))`` (picklable, for worker processes)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, x):
        return self.second(self.first(x))


def _mosaic_dataset(data: str, *, batch_size: int, seed: int, fn: Callable):
    from streaming import StreamingDataset

    class Mapped(StreamingDataset):  # MosaicML's documented way to transform: override __getitem__
        def __getitem__(self, idx):
            return fn(super().__getitem__(idx))

    return Mapped(local=data, shuffle=True, shuffle_seed=seed, batch_size=batch_size)


def _pickle_tuple(record: bytes):
    return _dict_tuple(pickle.loads(record))


class SpdlLoader:
    """SPDL's ``spdl.dataloader.DataLoader`` (a thread pipeline) over the image files, made per epoch over a
    seeded shuffle of the paths (its documented source: an iterable of paths); ``threads`` read (and decode)."""

    def __init__(self, folder: str, *, batch_size: int, threads: int, seed: int, fn: Callable):
        self.items, self.batch_size, self.threads, self.seed, self.fn = list_images(folder), batch_size, threads, seed, fn
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        from spdl.dataloader import DataLoader

        order = list(self.items)
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        yield from DataLoader(order, preprocessor=self.fn, batch_size=self.batch_size, aggregator=raw_collate,
                              num_threads=self.threads)


class _ReadFile:
    """``(path, key, label)`` -> ``fn((key, bytes, label))`` (SPDL's preprocessor)."""

    def __init__(self, fn: Callable | None):
        self.fn = fn

    def __call__(self, item):
        s = read_item(item)
        out = (s["key"], s["image"], s["cls"])
        return self.fn(out) if self.fn else out


def absl_flags_parsed(*_) -> None:
    """Mark absl's flags parsed (at their defaults) where nothing parsed them, as in a program not started by
    ``absl.app.run``: Grain reads its flags (``--grain_enable_multiprocess_worker_profiling`` where JAX is
    installed) and raises ``UnparsedFlagAccessError`` otherwise. Also an ``mp_prefetch`` worker_init_fn: its
    workers are spawned, fresh interpreters with their flags unparsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


GRAIN_READ = {"num_threads": 2, "prefetch_buffer_size": 2}  # in batches, not records (see GrainLoader)


def packed_collate(samples: list) -> tuple[list, object, list, list]:
    """A batch of ``(key, bytes, label)`` samples as ``(keys, one uint8 NumPy array of the values end to end,
    offsets, labels)``: the one large leaf Grain's workers hand over through shared memory."""
    import numpy as np

    keys, values, labels = zip(*samples)
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    return list(keys), np.frombuffer(b"".join(values), dtype=np.uint8), offsets, list(labels)


def unpacked(batch) -> tuple[list, list, list]:
    """:func:`packed_collate`'s batch as ``(keys, values, labels)``, each value a view of the array (no copy)."""
    keys, flat, offsets, labels = batch
    return keys, [flat[a:b] for a, b in zip(offsets, offsets[1:])], labels


class GrainLoader:
    """Grain: ``MapDataset.source(ArrayRecordDataSource)`` -> ``shuffle`` -> ``repeat`` (epoch ``e`` is its slice
    ``[e*n, (e+1)*n)``) -> ``map`` -> ``batch`` -> ``to_iter_dataset(ReadOptions(**GRAIN_READ))`` ->
    ``mp_prefetch(MultiprocessingOptions(num_workers))`` with workers; resumes with the iterator's
    ``get_state`` / ``set_state``. absl's flags are marked parsed here and in the workers
    (:func:`absl_flags_parsed`).

    ReadOptions counts elements, and an element here is a batch: Grain's defaults (16 threads, 500 elements,
    documented as chosen for 1-10 KiB elements) read up to 500 batches ahead in every process, 16 batches built
    at once (the first one comes when they all do) by threads that starve the parent of CPU. Here each process
    reads 2 batches ahead, as the torch rows' ``prefetch_factor=2`` (2 cores, 24,000 ~100 KB records, 2
    workers: ~1-2k samples/s before, ~6k/s after; decoding: first batch 60 s before, 6 s after).
    ``pack`` (raw bytes, with workers): each batch's values go as one NumPy array (:func:`packed_collate`), which
    Grain's workers hand over in shared memory, as its docs say large elements should travel; a pickled list of
    bytes instead goes through the worker's pipe, and a worker stopped with one in flight blocks on exit until
    Grain kills it (25 s a worker, one after another, at every close of a cut pass).
    """

    def __init__(self, data: str, *, batch_size: int, workers: int, seed: int, fn: Callable, pack: bool = False):
        import grain

        absl_flags_parsed()
        paths = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".array_record"))
        self.source = grain.sources.ArrayRecordDataSource(paths)
        self.batch_size, self.workers, self.seed, self.fn = batch_size, workers, seed, fn
        self.pack = pack and workers > 0
        self.epoch, self._it, self._state = 0, None, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self):
        return self._it.get_state()

    def load_state_dict(self, state) -> None:
        self._state = state

    def __iter__(self):
        import grain

        n, e = len(self.source), self.epoch
        ds = grain.MapDataset.source(self.source).shuffle(seed=self.seed).repeat(e + 1)[e * n:(e + 1) * n]
        ds = ds.map(self.fn).batch(self.batch_size, batch_fn=packed_collate if self.pack else raw_collate)
        ds = ds.to_iter_dataset(grain.ReadOptions(**GRAIN_READ))
        if self.workers:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers),
                                worker_init_fn=absl_flags_parsed)
        it = self._it = iter(ds)
        if self._state is not None:
            it.set_state(self._state)
            self._state = None
        try:
            yield from (map(unpacked, it) if self.pack else it)
        finally:
            close = getattr(it, "close", None)
            if callable(close):
                close()


def _energon_encoder(fn: Callable):
    from megatron.energon import DefaultTaskEncoder

    class RawEncoder(DefaultTaskEncoder):
        decoder = None  # Energon's documented switch: payloads stay bytes

        def encode_sample(self, sample):
            return fn((sample.__key__, sample.image, int(sample.label)))

        def batch(self, samples):
            return raw_collate(samples)

    return RawEncoder()


class EnergonLoader:
    """Megatron-Energon: ``get_train_dataset`` over the prepared WebDataset (a task encoder that keeps the bytes,
    ``decoder = None``) -> ``get_savable_loader``; ``repeat=False`` makes each pass one epoch, ``repeat=True``
    (the default, as in its save/restore guide) an endless stream; resumes with ``save_state_rank`` /
    ``restore_state_rank``.

    With workers the savable loader keeps one iterator alive until it has read its epoch to the end: the next
    ``iter()`` after a pass cut short goes on with that epoch (``continues_cut_pass``), and closing the
    iterator would leave every later pass empty.
    """

    def __init__(self, data: str, *, batch_size: int, workers: int, seed: int, fn: Callable, repeat: bool = False):
        from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

        config = WorkerConfig(rank=0, world_size=1, num_workers=workers, seed_offset=seed)
        ds = get_train_dataset(data, batch_size=batch_size, shuffle_buffer_size=ENERGON_SHUFFLE,
                               max_samples_per_sequence=ENERGON_SEQUENCE, worker_config=config,
                               task_encoder=_energon_encoder(fn), repeat=repeat)
        self.loader = get_savable_loader(ds)
        self.continues_cut_pass = workers > 0

    def state_dict(self):
        return self.loader.save_state_rank()

    def load_state_dict(self, state) -> None:
        self.loader.restore_state_rank(state)

    def __iter__(self):
        return iter(self.loader)


def _copy_threads_said() -> str:
    """How the main process copies large raw batches out of the workers' segments here (the row says it)."""
    from loaders.dataloader.copyout import copy_threads

    n = copy_threads()
    return f", raw leaves of large batches copied out in {n} threads" if n > 1 else ""


def describe(system: str, workers: int) -> str:
    """What ``system``'s loader does with ``workers`` (the words every row carries)."""
    procs = f"{workers} worker processes" if workers else "in the main process"
    return {
        "torch": f"torch DataLoader over a files Dataset, shuffle=True, {procs}",
        "webdataset": f"webdataset.WebDataset (shardshuffle, .shuffle(1000)) in torch's DataLoader, {procs}",
        "datapipe": f"loaders.DataLoader over ShardStream(shuffle=True, shuffle_buffer=200), {procs}"
                    + (_copy_threads_said() if workers else ""),
        "litdata": f"litdata StreamingDataset(shuffle=True) + StreamingDataLoader, {procs}",
        "mosaicml": f"streaming.StreamingDataset(shuffle=True) + StreamingDataLoader, {procs}",
        "spdl": f"spdl.dataloader.DataLoader over the shuffled file paths, "
                f"{max(1, workers)} thread{'s' if workers > 1 else ''}, one process",
        "grain": "grain MapDataset(ArrayRecordDataSource).shuffle.map.batch.to_iter_dataset (ReadOptions "
                 f"{GRAIN_READ['num_threads']} threads, {GRAIN_READ['prefetch_buffer_size']} batches ahead)"
                 + (f".mp_prefetch({workers} worker processes; a raw batch's bytes as one NumPy array, in shared "
                    "memory)"
                    if workers else ", one process"),
        "energon": f"megatron.energon get_train_dataset (shuffle buffer {ENERGON_SHUFFLE}, "
                   f"max_samples_per_sequence {ENERGON_SEQUENCE}) + get_savable_loader, {procs}",
    }[system]


def open_loader(system: str, data: str, *, batch_size: int, workers: int, seed: int = 0,
                decode_size: int | None = None, cache_dir: str | None = None, endless: bool = False,
                storage=None):
    """``system``'s documented loader over its own written ``data``: batches of ``(keys, values, labels)``.

    Values are the encoded bytes, or with ``decode_size`` the decoded, augmented image tensors.
    ``endless``: Energon's default endless stream (its save/restore path) instead of one epoch per pass.
    ``storage``: datapipe's ``StorageOptions`` (a probe's; the rows take the defaults).
    """
    import torch.utils.data

    decode = Decode(decode_size) if decode_size else None
    if system == "spdl":
        return SpdlLoader(data, batch_size=batch_size, threads=max(1, workers), seed=seed, fn=_ReadFile(decode))
    if system == "grain":
        return GrainLoader(data, batch_size=batch_size, workers=workers, seed=seed, pack=decode is None,
                           fn=_Then(_pickle_tuple, decode) if decode else _pickle_tuple)
    if system == "energon":
        return EnergonLoader(data, batch_size=batch_size, workers=workers, seed=seed, repeat=endless,
                             fn=decode or _identity)
    extra = {"prefetch_factor": 2, "persistent_workers": False} if workers else {}
    if system == "torch":
        ds = FilesDataset(data, decode)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                           collate_fn=raw_collate, generator=torch.Generator().manual_seed(seed),
                                           **extra)
    if system == "webdataset":
        import webdataset as wds

        urls = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".tar"))
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, nodesplitter=wds.single_node_only,
                            empty_check=False).shuffle(1000).map(_Then(_wds_tuple, decode) if decode else _wds_tuple)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate,
                                           **extra)
    if system == "datapipe":
        from datapipe import ShardStream
        from loaders import DataLoader

        stream = ShardStream(data, shuffle=True, shuffle_buffer=200, seed=seed,  # samples too (the README's)
                             **({"storage": storage} if storage is not None else {}))
        stream = stream.map(_Then(_stream_tuple, decode) if decode else _stream_tuple)
        return DataLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate, **extra)
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(data, shuffle=True, seed=seed, cache_dir=cache_dir,
                              transform=_Then(_dict_tuple, decode) if decode else _dict_tuple)
        return StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate,
                                   **({"prefetch_factor": 2} if workers else {}))
    if system == "mosaicml":
        from streaming import StreamingDataLoader

        ds = _mosaic_dataset(data, batch_size=batch_size, seed=seed,
                             fn=_Then(_dict_tuple, decode) if decode else _dict_tuple)
        return StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=raw_collate, **extra)
    raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")


def set_epoch_of(loader, epoch: int) -> None:
    for target in (loader, getattr(loader, "dataset", None)):
        fn = getattr(target, "set_epoch", None)
        if callable(fn):
            fn(epoch)
            return


def one_epoch(loader, *, cap_s: float | None = None) -> dict:
    """One epoch: samples, bytes, seconds, first batch time; with ``cap_s``, cut after that many seconds
    (``capped``: the epoch was not read to its end; the rate is over what was read, up to the cut). A cut epoch's
    iterator is closed, unless the loader's next ``iter()`` goes on with it (``continues_cut_pass``, Energon's
    workers); that close is the harness's doing, not the epoch's: it is timed apart (``close_s``)."""
    from datapipe.tools.bench.baselines import close

    n = nbytes = 0
    t0 = time.perf_counter()
    first, capped, closed = None, False, None
    it = iter(loader)
    try:
        for keys, values, _ in it:
            if first is None:
                first = time.perf_counter() - t0
            n += len(keys)
            nbytes += sum(len(v) for v in values)
            if cap_s is not None and time.perf_counter() - t0 >= cap_s:
                capped = True
                break
    finally:
        seconds = time.perf_counter() - t0
        if capped and not getattr(loader, "continues_cut_pass", False):
            close(it)
            closed = time.perf_counter() - t0 - seconds
    out = {"samples": n, "seconds": round(seconds, 3), "samples_per_s": round(n / seconds, 1) if seconds else None,
           "mb_per_s": round(nbytes / seconds / 1e6, 1) if seconds else None,
           "first_batch_s": round(first, 3) if first is not None else None}
    if closed is not None:
        out["close_s"] = round(closed, 3)
    return {**out, "capped": True} if capped else out


def steady_rate(it, *, skip: int, seconds: float | None, count: Callable[[tuple], int]) -> dict:
    """(After the first batch of ``it`` was taken) the rate over the batches of the next ``seconds`` (None: to the
    end), leaving out the ``skip`` batches that follow the first one (made beside it: a burst, not the rate);
    ``count(batch)``: its samples."""
    n, t1 = 0, time.perf_counter()
    for batch in it:
        if skip:
            skip -= 1
            t1 = time.perf_counter()
            continue
        n += count(batch)
        if seconds is not None and time.perf_counter() - t1 >= seconds:
            break
    took = time.perf_counter() - t1
    return {"steady_samples": n, "steady_seconds": round(took, 3),
            "steady_samples_per_s": round(n / took, 1) if n and took else None}
