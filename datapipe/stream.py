"""``ShardStream``: WebDataset samples from sharded tars on any storage, split over ranks and workers.

Iteration runs as small stages, each in its own module: the plan (which samples this worker of this
rank reads, :mod:`datapipe.order.plan`) -> the segment reader (samples, or LOST for what could not be
read, :mod:`datapipe.read.segments`) -> the shuffle buffer (:mod:`datapipe.order.shuffle`) -> the
per-sample steps (decode / map, :mod:`datapipe.decode`) -> delivery (drops what was lost, or pads it
so that ranks stay equal, :mod:`datapipe.order.padding`). Counts go to one ledger
(:mod:`datapipe.read.ledger`).

A worker's state is one counter, the draws of its delivery stage: the plan is a function of the
counts, the shape and the epoch, and the shuffle buffer and the segment reader are rebuilt from the
draw count by replay (:func:`datapipe.order.shuffle.shuffled`), so no other stage has a state to save.
Under DDP the delivery stage also notes the draw of the sample a lost one repeats (read again, alone,
by a pass resumed before its next sample) and the repeats it owes (:mod:`datapipe.order.padding`).
That counter is also what :meth:`ShardStream.mark` notes after each sample, for a stage downstream that
needs the state at a sample it holds (:meth:`ShardStream.state_before`) only now and then.
"""
from __future__ import annotations

import functools
import logging
import os
from numbers import Integral
from typing import Any, Callable, Iterator

import numpy as np
import torch.utils.data

from datapipe.decode import Decode, Map, stepped
from datapipe.errors import ErrorPolicy, OnError, check_on_error
from datapipe.marks import SampleMarks
from datapipe.order import elastic
from datapipe.order.padding import deliver
from datapipe.order.plan import SHARD_ORDER, samples_per_rank, shard_order, worker_plan
from datapipe.order.ranks import rank_world
from datapipe.order.shared_epoch import SharedEpoch
from datapipe.order.shuffle import drawn_position, shuffled
from datapipe.read.heap import keep_freed_memory
from datapipe.read.ledger import Ledger
from datapipe.read.options import StorageOptions, check_types
from datapipe.read.segments import LOST, SegmentReader
from datapipe.read.shards import Shards
from datapipe.read.spans import read_threads
from datapipe.read.standin import stand_in as rank_stand_in
from datapipe.state import check_identity
from datapipe.storage.cache import ShardCache
from datapipe.storage.urls import shard_urls

log = logging.getLogger("datapipe.stream")


class ShardStream(SampleMarks, SharedEpoch, torch.utils.data.IterableDataset):
    """An iterable dataset of WebDataset samples (``__key__``, ``__url__``, one bytes value per extension).

    Every sample is read exactly once per epoch over all ranks x DataLoader workers, and every rank
    yields the same number of samples (``ceil(N / world_size)``: at most ``world_size - 1`` samples
    repeat to even the ranks out). Order is deterministic for a given (seed, epoch, world_size,
    num_workers). Sample counts come from ``manifest.json`` beside the shards; shards it does not
    list are counted once by walking their headers (logged) and the counts are cached.
    ``decode(...)`` and ``map(fn)`` add per-sample steps that run where samples are read.

    Args:
        urls: a brace pattern, ``::``-joined patterns or a list of shard URLs (any fsspec storage).
        shuffle: shuffle the shard order each epoch (from ``seed`` and the epoch).
        seed: the seed of every random choice.
        shuffle_buffer: samples held in a shuffle buffer per worker (0: none).
        rank, world_size: this process's share (default: torch.distributed, else RANK / WORLD_SIZE, else 0 / 1).
        on_error: ``"raise"`` (a ``DataError`` naming the shard and key), ``"skip"`` (drop the bad sample,
            or the unreadable rest of a shard, and count it in ``stats()``), ``"warn"`` (skip and log) or a
            callable that gets the ``DataError`` and raises to stop or returns to skip. With
            ``world_size > 1`` a lost sample is replaced by a repeat (``stats()["padded"]``); a rank with no readable
            sample at all raises ``DataError`` (it has nothing to repeat, and a short epoch would hang DDP).
        storage_options: fsspec's options for the shards' storage (credentials, endpoint, profile...).
        cache_dir: keep remote shards in this local directory and read them from there in later epochs.
        cache_limit: bound the cache's size in bytes (least recently used shards evicted).
        counts: samples per shard (a list, or a dict by URL), when no manifest has them.
        storage: the rarer storage settings (:class:`~datapipe.read.options.StorageOptions`: retries,
            timeout, backoff, ``pipe:`` URLs, zero-copy values).
    """

    def __init__(
        self,
        urls: str | list[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        storage_options: dict | None = None,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        counts: dict[str, int] | list[int] | None = None,
        storage: StorageOptions | None = None,
    ):
        check_types("", shuffle=(shuffle, bool), seed=(seed, Integral), shuffle_buffer=(shuffle_buffer, Integral),
                    rank=(rank, (Integral, type(None))), world_size=(world_size, (Integral, type(None))),
                    counts=(counts, (dict, list, tuple, type(None))),
                    storage_options=(storage_options, (dict, type(None))),
                    cache_dir=(cache_dir, (str, os.PathLike, type(None))),
                    cache_limit=(cache_limit, (Integral, type(None))), storage=(storage, (StorageOptions, type(None))))
        if not (isinstance(on_error, str) or callable(on_error)):
            raise TypeError(f"on_error must be a handler name or a callable, got {type(on_error).__name__} "
                            f"{on_error!r}")
        check_on_error(on_error)
        self._init_args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        if shuffle_buffer < 0:
            raise ValueError("shuffle_buffer must be >= 0 (0 disables the sample shuffle buffer)")
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if world_size is not None and not (world_size >= 1 and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if cache_limit is not None and cache_dir is None:
            raise ValueError("cache_limit needs cache_dir: give the local directory to cache remote shards in")
        self.storage = storage = storage if storage is not None else StorageOptions()
        self.storage_options = storage_options = storage_options or {}
        self.urls = shard_urls(urls, allow_pipe=storage.allow_pipe, storage_options=storage_options)
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.rank = rank
        self.world_size = world_size
        self.on_error = on_error
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.epoch = 0
        self._errors = ErrorPolicy(on_error, log=log)  # counts errors, skipped, last_errors
        self._ledger = Ledger(self._errors)
        self._shards = Shards(self.urls, storage_options=storage_options, storage=storage, ledger=self._ledger,
                              counts=counts,
                              cache=ShardCache(cache_dir, limit=cache_limit) if cache_dir is not None else None)
        self._steps: tuple = ()  # per-sample steps (decode, map), run where the samples are read
        self._resume: dict | None = None
        self._epoch_plan: dict | None = None  # the plan basis of an elastically resumed epoch
        self._loaded_shape: dict | None = None
        self._total: int | None = None
        self._positions: dict[int, dict[str, Any]] = {}
        self._position: dict[str, Any] | None = None  # this process's worker's position in the pass under way
        self._pass_epoch: int | None = None  # the epoch of that pass (set_epoch may have chosen the next since)
        self._num_workers = 0

    def replace(self, **changes: Any) -> "ShardStream":
        """A new stream with the same settings (and steps) except ``changes``; a fresh epoch 0.

        ``changes``: constructor keyword names, or :class:`StorageOptions` field names (``retries=2``).
        """
        fields = set(StorageOptions.__dataclass_fields__)
        unknown = sorted(set(changes) - set(self._init_args) - fields)
        if unknown:
            raise ValueError(f"ShardStream has no option {unknown[0]!r}; options: "
                             f"{sorted(set(self._init_args) | fields)}")
        grouped = {k: changes.pop(k) for k in list(changes) if k in fields}
        if grouped:
            base = changes.get("storage") or self.storage
            changes["storage"] = StorageOptions(**{**{f: getattr(base, f) for f in fields}, **grouped})
        out = type(self)(**{**self._init_args, **changes})
        out._steps = self._steps
        return out

    # ---- per-sample steps (datapipe.decode) ---------------------------------------------------
    def decode(self, images: str = "pil") -> "ShardStream":
        """A new stream whose samples are decoded by extension, in the process that reads them.

        Images (``jpg``, ``jpeg``, ``png``, ``webp``, ...) become PIL RGB images (``"pil"``), numpy uint8
        HWC arrays (``"rgb8"``) or uint8 CHW tensors (``"torch"``); always ``cls`` / ``cls2`` / ``index`` /
        ``id`` -> int, ``txt`` -> str, ``json`` -> object, ``npy`` -> numpy array; others stay bytes.
        A sample that fails to decode goes to ``on_error`` (a ``DataError`` naming its shard and key).
        """
        return self._with_step(Decode(images))

    def map(self, fn: Callable[[Any], Any]) -> "ShardStream":
        """A new stream whose samples are ``fn(sample)`` (after the steps before it), run where samples are read.

        ``fn`` must pickle when DataLoader workers start by spawn (a module-level function). Its
        exceptions go to ``on_error`` as a ``DataError`` naming the sample's shard and key.
        """
        return self._with_step(Map(fn))

    def _with_step(self, step) -> "ShardStream":
        """A new stream (same settings, epoch and pending resume; its own counts) with ``step`` appended."""
        out = self.replace()
        out._steps = self._steps + (step,)
        out.epoch, out._resume, out._loaded_shape = self.epoch, self._resume, self._loaded_shape
        return out

    # ---- shards ---------------------------------------------------------------------------------
    @property
    def counts(self) -> list[int]:
        """Samples per shard: given, else from the manifest, else from the count cache, else counted once."""
        return self._shards.counts

    def _counts_array(self) -> np.ndarray:
        """The counts as an integer array (made once: the plan's arithmetic runs on it)."""
        counts = self.counts
        cached = self.__dict__.get("_counts_np")
        if cached is None or cached[0] is not counts:
            if isinstance(counts, np.ndarray) and counts.dtype in (np.int32, np.int64):
                array = counts  # the manifest's column already (no copy of a million counts)
            else:
                try:
                    array = np.array(counts, dtype=np.int32)  # half the memory of int64; the plan sums in int64
                except OverflowError:
                    array = np.array(counts, dtype=np.int64)
            cached = self._counts_np = (counts, array, int(array.sum(dtype=np.int64)))
        return cached[1]

    def _count_total(self) -> int:
        """All shards' samples (summed once per counts list)."""
        self._counts_array()
        return self._counts_np[2]

    def __len__(self) -> int:
        """Samples this rank yields per epoch."""
        _, world = self._rank_world()
        return samples_per_rank(self._count_total(), world)

    def __getstate__(self):
        self.counts  # count once in the parent, not in every worker
        if self._shards.cache is not None:
            self._shards.entries()
        state = dict(self.__dict__)
        if self.world_size is None:  # workers see the parent's rank / world size, however they start
            state["rank"], state["world_size"] = self._rank_world()
        return state

    def open_ledger(self, num_workers: int, *, again: bool = False, context=None) -> None:
        """(``loaders.DataLoader``, before each pass with ``num_workers`` worker processes.) Count the shards here,
        once; the loss ledger numbers the pass and, unless the workers ran one (persistent: ``again``), gives each a
        shared row, so that what they read and lose reaches this process's ``stats()`` (read.ledger.open_workers)."""
        self.counts
        self._ledger.open_workers(num_workers, again=again, context=context, shards=len(self.urls))

    # ---- epochs and state ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (shard order, shuffle seeds); loader passes after it count on from it
        (:mod:`datapipe.order.shared_epoch`: without it, each loader pass is the one after the last begun)."""
        self.epoch = int(epoch)  # persistent workers' copies follow (datapipe.order.shared_epoch)

    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer,
                "shards": self._shards.identity(), "shard_order": SHARD_ORDER}

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: the epoch, the shape (rank, world_size, num_workers), each worker's draw
        count, and what it was taken over (``seed``, ``shuffle``, ``shuffle_buffer``, ``shards``).

        The states of all ranks merge into one global state (``datapipe.order.elastic.merge_states`` /
        ``gather_state``) that ``load_state_dict`` resumes on any shape.
        """
        rank, world = self._rank_world()
        epoch = self._pass_epoch if self._positions and self._pass_epoch is not None else self.epoch
        if self._total is None and self._positions:  # a pass made, not read yet: its total, as it will count it
            self._total = self._count_total()
        out = {"kind": "ShardStream", "epoch": epoch, **self._identity(), "world_size": world, "rank": rank,
               "num_workers": self._num_workers, "workers": {w: dict(p) for w, p in self._positions.items()},
               "total": self._total, "generation": 0, "base": None}
        plan = self._epoch_plan if self._epoch_plan is not None and self._epoch_plan["epoch"] == epoch else None
        if plan is not None:
            out.update(generation=plan["generation"], base=plan["base"])
        resume = self._resume
        if resume is not None and resume["epoch"] == self.epoch and not self._positions:
            out.update(self._pending_state(resume))  # loaded, not read from yet: the loaded position
        return out

    def _pending_state(self, resume: dict) -> dict[str, Any]:
        """The state entries of a resume not yet read from: its positions (or, for a replanned epoch, its
        new plan with nothing of it delivered), so that a state taken now loses nothing."""
        total = self._count_total()
        info = torch.utils.data.get_worker_info()
        num_workers = info.num_workers if info is not None else self._num_workers
        same = max(1, resume["num_workers"]) == max(1, num_workers) and resume["world_size"] in (None,
                                                                                               self._rank_world()[1])
        if resume.get("reshape") is not None and not same:  # as elastic.start_of will decide
            return {"num_workers": num_workers, "workers": {},
                    "first_worker": 0, "total": total, "generation": resume["reshape"]["generation"],
                    "base": elastic.pack_ranges(resume["reshape"]["base"])}
        return {"num_workers": resume["num_workers"], "workers": {w: dict(p) for w, p in resume["workers"].items()},
                "first_worker": resume["first_worker"], "total": total, "generation": resume["generation"],
                "base": None if resume["base"] is None else elastic.pack_ranges(resume["base"])}

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume: the next iteration of the saved epoch yields exactly its rest (other epochs start afresh).

        ``state``: this rank's own state (same shape only), or the global state of all ranks
        (``datapipe.order.elastic.merge_states``, or the list of per-rank states): on the same shape each rank
        resumes bit-exactly; on another ``world_size`` / worker count the epoch's undelivered samples
        are planned again over the new shape (see ``datapipe.order.elastic``). A state taken over
        other shards or with another ``seed`` / ``shuffle`` / ``shuffle_buffer`` is a ValueError naming them.
        """
        if isinstance(state, (list, tuple)) or (not elastic.is_global(state) and isinstance(state, dict)
                                                 and state.get("world_size") == 1 and state.get("rank") == 0):
            state = elastic.merge_states(list(state) if isinstance(state, (list, tuple)) else [state])
        self.check_loadable(state)
        self._positions, self._position, self._pass_epoch = {}, None, None  # state_dict: the loaded position now
        reshape = None
        if elastic.is_global(state):
            base, generation = elastic.remaining(state, total=self._count_total(), shuffle_buffer=self.shuffle_buffer)
            reshape = {"base": base, "generation": generation + 1}
            rank, world = self._rank_world()
            self._loaded_shape = elastic.shape(state)
            if world != state["world_size"]:
                self.epoch = int(state["epoch"])
                self._resume = {"epoch": self.epoch, "num_workers": -1, "world_size": state["world_size"],
                                "first_worker": 0, "workers": {}, "reshape": reshape}
                return
            state = state["ranks"][rank]
        if reshape is None and state.get("world_size") is not None:
            self._loaded_shape = {"world_size": int(state["world_size"]),
                                  "num_workers": max(1, int(state["num_workers"]))}
        self.epoch = int(state["epoch"])
        base = state.get("base")
        self._resume = {"epoch": self.epoch, "num_workers": int(state["num_workers"]),
                        "world_size": state.get("world_size"),
                        "first_worker": int(state.get("first_worker", 0)),
                        "workers": {int(w): dict(p) for w, p in state["workers"].items()},
                        "generation": int(state.get("generation", 0)),
                        "base": None if base is None else elastic.unpack_ranges(base),
                        "reshape": reshape}

    def forget_resume(self) -> None:
        """Drop a loaded resume that worker processes took with their copies of this stream (``loaders.DataLoader``
        calls it once a resumed pass's workers started): this object's own next pass is a whole epoch."""
        self._resume = None

    def check_loadable(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """A ValueError unless ``load_state_dict`` takes ``state`` (this stream is not changed): one naming a
        malformed entry, or every setting (``seed``, ``shuffle``, ``shuffle_buffer``, ``shards``) it was taken
        with that differs from this stream's, with both values. Loaders call it when a checkpoint is loaded."""
        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(list(state))
        for rank_state in (state["ranks"] if elastic.is_global(state) else [state]):
            elastic.check_stream_state(rank_state)
            if self.shuffle and "shards" in rank_state and "shard_order" not in rank_state:
                raise ValueError("this checkpoint was taken by an earlier datapipe, whose shuffled shard order differs "
                                 "from this one's: resuming it here would repeat some shards and skip others. Resume "
                                 "it with the datapipe version that wrote it, or start this epoch anew")
            check_identity(rank_state, "ShardStream", self._identity())

    def stats(self) -> dict[str, Any]:
        """Counts of this stream over this process and its DataLoader workers (``loaders.DataLoader``):
        samples yielded, skipped (bad or lost), errors and the last messages, padded repeats, retries,
        shards opened, bytes read, cache hits.

        ``resumed_from``: the shape (``world_size``, ``num_workers``) of the last state loaded, or None.
        """
        return {**self._ledger.totals(), "resumed_from": self._loaded_shape}

    # ---- iteration ----------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        return rank_world(self)

    def __iter__(self) -> Iterator[Any]:
        """A pass, fixed here, as ``iter()`` is called: its epoch, the loaded resume it takes, its rank and worker
        share (so its plan and order), whatever happens to the stream before the pass is read (another ``iter()``
        at another epoch, without DataLoader workers, too). The samples come from the generator it returns, which
        counts the shards and reads as it is first read; an error in fixing the pass is raised by that ``next()``."""
        try:
            return self._pass(self._plan_pass())
        except Exception as e:  # noqa: BLE001 - raised at the first next(), where torch expects a pass's errors
            return _raising(e)

    def _plan_pass(self) -> dict[str, Any]:
        """What decides a pass's samples and their order, taken now (the loaded resume is used up here)."""
        self._follow_epoch()  # a persistent worker's copy: the epoch the main process set
        info = torch.utils.data.get_worker_info()
        num_workers = info.num_workers if info is not None else 0
        physical = info.id if info is not None else 0
        epoch = self.epoch
        rank, world = self._rank_world()
        resume = self._resume if self._resume is not None and self._resume["epoch"] == epoch else None
        if info is None:
            self._resume = None  # used up here; DataLoader workers use their own copies
        logical, position, base, generation = elastic.start_of(resume, worker=physical, num_workers=num_workers,
                                                               world_size=world)
        if resume is not None and resume.get("reshape") is not None and base is resume["reshape"]["base"]:
            elastic.say_replanned(self._loaded_shape, rank=rank, world=world, worker=physical, num_workers=num_workers)
        where = {"epoch": epoch, "num_workers": num_workers, "positions": {logical: position}, "position": position,
                 "total": None,  # the shards' samples, counted as the pass is first read (or by state_dict)
                 "epoch_plan": ({"epoch": epoch, "base": elastic.pack_ranges(base), "generation": generation}
                                if generation else None)}
        self._enter(where)
        return {"where": where, "info": info, "physical": physical, "world": world, "logical": logical, "rank": rank,
                "base": base, "steps": self._steps, "mark": self._ledger.pass_mark(epoch),
                "seed": elastic.worker_seed(self.seed, epoch, rank, logical, world, num_workers, generation)}

    def _enter(self, where: dict[str, Any]) -> None:
        """Make ``where`` (a pass's epoch and positions) what ``state_dict`` and the sample marks describe: the pass
        made last, and then the one that handed out a sample last (passes of one stream may interleave)."""
        self._pass_epoch, self._num_workers, self._total = where["epoch"], where["num_workers"], where["total"]
        self._positions, self._position, self._epoch_plan = where["positions"], where["position"], where["epoch_plan"]

    def _pass(self, p: dict[str, Any]) -> Iterator[Any]:
        """The samples of the pass ``p`` (:meth:`_plan_pass`)."""
        where, info, steps, seed = p["where"], p["info"], p["steps"], p["seed"]
        position = where["position"]
        plan_of = functools.partial(worker_plan, self._counts_array(), shard_order(
            len(self.urls), shuffle=self.shuffle, seed=self.seed, epoch=where["epoch"]), rank=p["rank"],
            world_size=p["world"], num_workers=max(1, where["num_workers"]), base=p["base"])  # a worker's run
        plan = plan_of(worker=p["logical"])
        where["total"] = self._count_total()
        if self._position is position:
            self._total = where["total"]
        if info is not None and self._ledger.enter(p["physical"]):
            self._shards.count_cache_failures(counted=False)  # a worker counts only its own
        self._ledger.begin(p["mark"])
        if position["done"]:
            return
        self._ledger.counts["padded"] += plan.padded
        if self.storage.keep_freed_memory:
            keep_freed_memory()
        reader = SegmentReader(self._shards, zero_copy=self.storage.zero_copy,
                               read_threads=read_threads(self.storage.read_threads, in_worker=info is not None))
        if self.shuffle_buffer <= 1:
            items = reader.items(plan, position["draws"])
        else:
            items = shuffled(lambda first, keep: reader.positions(plan, first, keep), size=self.shuffle_buffer,
                             seed=seed, length=len(plan), draws=position["draws"],
                             read_items=lambda first: reader.items(plan, first))
        if steps:
            items = stepped(items, steps, lost=LOST, lose=reader.lose)

        def reread(draw: int) -> Any:
            """The sample of an earlier draw of this pass, read again alone (None: lost this time)."""
            at = draw - 1 if self.shuffle_buffer <= 1 else drawn_position(self.shuffle_buffer, seed, len(plan), draw)
            (item,) = reader.items(plan.sample_at(at), 0)
            if steps:
                (item,) = stepped([item], steps, lost=LOST, lose=reader.lose)
            return None if item is LOST else item

        stand_in = functools.partial(rank_stand_in, reader, plan_of, worker=p["logical"], steps=steps, rank=p["rank"],
                                     num_workers=max(1, where["num_workers"]), world_size=p["world"])
        try:
            for item in deliver(items, position, self._ledger.counts, lost=LOST, pad=p["world"] > 1, reread=reread,
                                stand_in=stand_in):
                if self._position is not position:  # another pass of this object handed out the last sample
                    self._enter(where)
                yield item
            position["done"] = True
        finally:
            self._ledger.publish()


def _raising(e: Exception) -> Iterator[Any]:
    raise e
    yield  # a generator: raises at its first next()
