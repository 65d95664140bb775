"""``ShardStream``: WebDataset samples from sharded tars on any storage, split over ranks and workers."""
from __future__ import annotations

import copy
import logging
import os
from numbers import Integral, Real
from typing import Any, Iterator

import torch.utils.data

from datapipe.decode import Decode, Map, run_steps
from datapipe.errors import DataError, ErrorPolicy, OnError, check_on_error
from datapipe.order import elastic
from datapipe.order.plan import WorkerPlan, samples_per_rank, shard_order, worker_plan
from datapipe.order.shuffle import ShuffleBuffer, replay_positions
from datapipe.segments import LOST, SegmentReading
from datapipe.shard_counts import ShardCounts
from datapipe.state import check_state
from datapipe.storage.cache import ShardCache
from datapipe.storage.files import DEFAULT_TIMEOUT, with_timeouts
from datapipe.storage.urls import expand_urls

log = logging.getLogger("datapipe.stream")


def _check_types(**args: tuple[Any, type | tuple[type, ...]]) -> None:
    """``TypeError`` naming the first argument whose value is not of its type (bools are not numbers)."""
    for name, (value, types) in args.items():
        types = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join({type(None): "None", Integral: "int", Real: "a number"}.get(t, t.__name__)
                                 for t in types)
            raise TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")


def default_rank_world() -> tuple[int, int]:
    """torch.distributed if initialised, else the RANK / WORLD_SIZE variables, else 0 / 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class ShardStream(ShardCounts, SegmentReading, torch.utils.data.IterableDataset):
    """An iterable dataset of WebDataset samples (``__key__``, ``__url__``, one bytes value per extension).

    Every sample is read exactly once per epoch over all ranks x DataLoader workers, and every rank
    yields the same number of samples (``ceil(N / world_size)``: at most ``world_size - 1`` samples
    repeat to even the ranks out). Order is deterministic for a given (seed, epoch, world_size,
    num_workers). Sample counts come from ``manifest.json`` beside the shards; shards it does not
    list are counted once by walking their headers (logged; in parallel threads) and the counts are
    cached (``datapipe.tar.counts``; ``datapipe index`` stores them up front).

    ``zero_copy=True`` hands out values of local uncompressed shards as memoryviews into the
    memory-mapped file instead of bytes (no copy; ``np.frombuffer`` and DALI take them as they are).

    ``on_error``: ``"raise"`` raises ``DataError`` naming the shard and key (and the byte, for tar
    damage: any cut, a partial header, a file that is not a tar); ``"skip"`` drops the bad sample (or
    the unreadable rest of a shard, after every complete sample before it) and counts it in
    ``stats()``; ``"warn"`` also logs; a callable (webdataset's handler model) gets the ``DataError``
    and raises to stop or returns to skip, counted like ``"skip"``. With ``world_size > 1`` a lost
    sample is replaced by a repeat of one this worker delivered (counted in ``stats()["padded"]``),
    so ranks stay equal.

    Remote reads retry transient failures ``retries`` times in a row with exponential backoff from
    ``backoff`` seconds, resuming at the byte they had reached (no sample twice); every remote wait
    has a ``timeout`` (seconds; set as the HTTP / S3 client's connect and read timeouts unless
    ``storage_options`` sets its own). ``cache_dir``: keep remote shards in this local directory
    (shared by the processes of a node) and read them from there in later epochs; ``cache_limit``
    bounds its size in bytes (least recently used shards are evicted; see ``datapipe.storage.cache``).
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
        counts: dict[str, int] | list[int] | None = None,
        retries: int = 5,
        allow_pipe: bool = False,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        zero_copy: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT,
        backoff: float = 0.2,
    ):
        _check_types(shuffle=(shuffle, bool), seed=(seed, Integral), shuffle_buffer=(shuffle_buffer, Integral),
                     rank=(rank, (Integral, type(None))), world_size=(world_size, (Integral, type(None))),
                     storage_options=(storage_options, (dict, type(None))),
                     counts=(counts, (dict, list, tuple, type(None))), retries=(retries, Integral),
                     allow_pipe=(allow_pipe, bool), cache_dir=(cache_dir, (str, os.PathLike, type(None))),
                     cache_limit=(cache_limit, (Integral, type(None))), zero_copy=(zero_copy, bool),
                     timeout=(timeout, (Real, type(None))), backoff=(backoff, Real))
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
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds (or None for the clients' own), got {timeout}")
        if retries < 0 or backoff < 0:
            raise ValueError("retries and backoff must be >= 0")
        if cache_limit is not None and cache_dir is None:
            raise ValueError("cache_limit needs cache_dir: give the local directory to cache remote shards in")
        self.urls = expand_urls(urls, allow_pipe=allow_pipe, storage_options=storage_options)
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.rank = rank
        self.world_size = world_size
        self.on_error = on_error
        self.storage_options = storage_options or {}
        self.retries = retries
        self.allow_pipe = allow_pipe
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.zero_copy = zero_copy
        self.timeout = timeout
        self.backoff = backoff
        self._cache = ShardCache(cache_dir, limit=cache_limit) if cache_dir is not None else None
        self.epoch = 0
        self._manifest: dict[str, dict] | None = None
        self._counts = self._given_counts(counts)
        self._damage: dict[str, str] = {}  # counted shards found damaged: url -> "shard damaged at byte N: ..."
        self._resume: dict | None = None
        self._epoch_plan: dict | None = None  # the plan basis of an elastically resumed epoch
        self._loaded_shape: dict | None = None
        self._total: int | None = None
        self._positions: dict[int, dict[str, Any]] = {}
        self._num_workers = 0
        self._stats = {"samples": 0, "padded": 0, "retries": 0, "shards_opened": 0, "bytes_read": 0, "cache_hits": 0,
                       "cache_failures": 0}
        self._errors = ErrorPolicy(on_error, log=log)  # counts errors, skipped, last_errors
        self._steps: tuple = ()  # per-sample steps (decode, map), run where the samples are read

    def replace(self, **changes: Any) -> "ShardStream":
        """A new stream with the same settings except ``changes`` (constructor keyword names); a fresh epoch 0."""
        unknown = sorted(set(changes) - set(self._init_args))
        if unknown:
            raise ValueError(f"ShardStream has no option {unknown[0]!r}; options: {sorted(self._init_args)}")
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

    def map(self, fn) -> "ShardStream":
        """A new stream whose samples are ``fn(sample)`` (after the steps before it), run where samples are read.

        ``fn`` must pickle when DataLoader workers start by spawn (a module-level function). Its
        exceptions go to ``on_error`` as a ``DataError`` naming the sample's shard and key.
        """
        return self._with_step(Map(fn))

    def _with_step(self, step) -> "ShardStream":
        """A copy of this stream (same settings, epoch and pending resume; fresh counts) with ``step`` appended."""
        out = copy.copy(self)
        out._steps = self._steps + (step,)
        out._stats = dict.fromkeys(self._stats, 0)
        out._errors = ErrorPolicy(self.on_error, log=log)
        out._positions = {}
        return out

    # ---- storage (counts: datapipe.shard_counts; segment reads: datapipe.segments) ---------
    def _options(self, url: str) -> dict:
        return with_timeouts(url, self.storage_options, self.timeout)

    def __len__(self) -> int:
        """Samples this rank yields per epoch."""
        _, world = self._rank_world()
        return samples_per_rank(sum(self.counts), world)

    def __getstate__(self):
        self.counts  # count once in the parent, not in every worker
        state = dict(self.__dict__)
        if self._cache is not None:
            self._manifest_entries()
            state["_manifest"] = self._manifest
        if self.world_size is None:  # workers see the parent's rank / world size, however they start
            state["rank"], state["world_size"] = self._rank_world()
        return state

    # ---- epochs and state ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: the epoch, the shape (rank, world_size, num_workers), each worker's draw count.

        The states of all ranks merge into one global state (``datapipe.order.elastic.merge_states`` /
        ``gather_state``) that ``load_state_dict`` resumes on any shape.
        """
        rank, world = self._rank_world()
        plan = self._epoch_plan if self._epoch_plan is not None and self._epoch_plan["epoch"] == self.epoch else None
        return {"kind": "ShardStream", "epoch": self.epoch, "seed": self.seed, "world_size": world, "rank": rank,
                "num_workers": self._num_workers,
                "workers": {w: dict(p) for w, p in self._positions.items()},
                "shuffle_buffer": self.shuffle_buffer, "total": self._total,
                "generation": plan["generation"] if plan else 0, "base": plan["base"] if plan else None}

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume: the next iteration of the saved epoch yields exactly its rest (other epochs start afresh).

        ``state``: this rank's own state (same shape only), or the global state of all ranks
        (``datapipe.order.elastic.merge_states``, or the list of per-rank states): on the same shape each rank
        resumes bit-exactly; on another ``world_size`` / worker count the epoch's undelivered samples
        are planned again over the new shape (see ``datapipe.order.elastic``).
        """
        if isinstance(state, (list, tuple)) or (not elastic.is_global(state) and isinstance(state, dict)
                                                 and state.get("world_size") == 1 and state.get("rank") == 0):
            state = elastic.merge_states(list(state) if isinstance(state, (list, tuple)) else [state])
        reshape = None
        if elastic.is_global(state):
            base, generation = elastic.remaining(state, total=sum(self.counts), shuffle_buffer=self.shuffle_buffer)
            reshape = {"base": base, "generation": generation + 1}
            rank, world = self._rank_world()
            self._loaded_shape = elastic.shape(state)
            if world != state["world_size"]:
                self.epoch = int(state["epoch"])
                self._resume = {"epoch": self.epoch, "num_workers": -1, "world_size": state["world_size"],
                                "first_worker": 0, "workers": {}, "reshape": reshape}
                return
            state = state["ranks"][rank]
        check_state(state, "ShardStream", keys=("epoch", "num_workers", "workers"))
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

    def stats(self) -> dict[str, Any]:
        """Counts of this process: samples yielded, skipped (bad or lost), errors, padded repeats, retries.

        ``resumed_from``: the shape (``world_size``, ``num_workers``) of the last state loaded, or None.
        """
        return {**self._stats, **self._errors.stats(), "resumed_from": self._loaded_shape}

    # ---- iteration ----------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        if self.world_size is not None:
            return self.rank, self.world_size
        return default_rank_world()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        num_workers = info.num_workers if info is not None else 0
        physical = info.id if info is not None else 0
        rank, world = self._rank_world()
        resume = self._resume if self._resume is not None and self._resume["epoch"] == self.epoch else None
        if info is None:
            self._resume = None  # used up here; DataLoader workers use their own copies
        logical, draws, done = physical, 0, False
        base, generation = None, 0
        if resume is not None:
            same_workers = max(1, resume["num_workers"]) == max(1, num_workers)  # 0 and 1 worker split alike
            same_world = resume["world_size"] is None or resume["world_size"] == world
            if resume.get("reshape") is not None and not (same_workers and same_world):
                base, generation = resume["reshape"]["base"], resume["reshape"]["generation"]  # elastic: replan
            else:
                if not same_workers:
                    raise ValueError(f"state was saved with num_workers={resume['num_workers']}, "
                                     f"now {num_workers}: resume with the same number of workers, or load the "
                                     "global state (datapipe.order.elastic.merge_states) to resume on another shape")
                if not same_world:
                    raise ValueError(f"state was saved with world_size={resume['world_size']}, now {world}: load the "
                                     "global state (datapipe.order.elastic.merge_states) to resume on another shape")
                logical = (physical + resume["first_worker"]) % max(1, num_workers)
                saved = resume["workers"].get(logical, {})
                draws, done = int(saved.get("draws", 0)), bool(saved.get("done", False))
                base, generation = resume.get("base"), resume.get("generation", 0)
        self._num_workers = num_workers
        self._epoch_plan = ({"epoch": self.epoch, "base": elastic.pack_ranges(base), "generation": generation}
                            if generation else None)
        self._total = sum(self.counts)
        plan = worker_plan(self.counts, shard_order(len(self.urls), shuffle=self.shuffle, seed=self.seed,
                                                    epoch=self.epoch),
                           rank=rank, world_size=world, worker=logical, num_workers=max(1, num_workers), base=base)
        position = {"draws": draws, "done": done}
        self._positions = {logical: position}
        if done:
            return
        self._stats["padded"] += plan.padded
        seed = elastic.worker_seed(self.seed, self.epoch, rank, logical, world, num_workers, generation)
        yield from self._iterate(plan, seed, position)
        position["done"] = True

    def _iterate(self, plan: WorkerPlan, seed: int, position: dict[str, Any]) -> Iterator[Any]:
        """The worker's samples: read (through the shuffle buffer), stepped, then counted and delivered."""
        draws = position["draws"]
        if self.shuffle_buffer <= 1:
            items = self._read_items(plan, draws)
        else:
            items = self._shuffled(plan, seed, draws)
        if self._steps:
            items = self._stepped(items)
        if self._rank_world()[1] > 1:  # DDP: every rank yields as many as planned
            yield from self._pad_lost(items, position)
            return
        stats = self._stats
        for item in items:
            position["draws"] += 1
            if item is not LOST:
                stats["samples"] += 1
                yield item

    def _shuffled(self, plan: WorkerPlan, seed: int, draws: int) -> Iterator[Any]:
        """The plan's items through the shuffle buffer, from draw ``draws`` on (the buffer rebuilt by replay)."""
        buffer, pulled = replay_positions(self.shuffle_buffer, seed, len(plan), draws)
        source = self._read_positions(plan, min(buffer.slots + [pulled]))
        wanted = {p: i for i, p in enumerate(buffer.slots)}
        slots = [None] * len(buffer.slots)
        while wanted:
            pos, item = next(source)
            if pos in wanted:
                slots[wanted.pop(pos)] = (pos, item)
        live = ShuffleBuffer(self.shuffle_buffer, buffer.rng, slots)
        for _, item in live.run(item for item in source if item[0] >= pulled):
            yield item

    def _stepped(self, items: Iterator[Any]) -> Iterator[Any]:
        """Items through the decode/map steps; a sample whose step fails goes to ``on_error`` and is LOST."""
        steps = self._steps
        for item in items:
            if item is LOST:
                yield item
                continue
            try:
                yield run_steps(steps, item)
            except DataError as e:
                yield from self._lose(e, 1)

    def _pad_lost(self, items, position: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Deliver items; each LOST one becomes a repeat of a delivered sample (counted
        in ``padded``), so that a rank whose shards turned out shorter still yields its planned count."""
        last, owed = None, 0
        for item in items:
            position["draws"] += 1
            if item is LOST:
                if last is None:
                    owed += 1
                    continue
                self._stats["padded"] += 1
                yield last
                continue
            self._stats["samples"] += 1
            yield item
            last = item
            for _ in range(owed):
                self._stats["padded"] += 1
                yield item
            owed = 0
        if owed:
            log.warning("%d samples of this rank were lost and none was delivered to repeat: this rank yields "
                        "fewer samples than the others", owed)
