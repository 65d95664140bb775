"""``mix``: weighted, deterministic, resumable interleaving of several streams."""
from __future__ import annotations

import math
from numbers import Integral
from typing import Any, Iterable, Iterator, Sequence

import torch.utils.data

from datapipe.order import elastic
from datapipe.order.ranks import rank_world
from datapipe.order.shared_epoch import SharedEpoch
from datapipe.order.seeds import derive_seed
from datapipe.state import check_identity, check_state
from datapipe.words import counted

STOP = ("first", "all", "restart")
# what an epoch holds under each stop rule (Mix.stats()["epoch_holds"]; docs/loaders.md says the same)
EPOCH_HOLDS = {
    "first": "each reader (rank x DataLoader worker) mixes its own share of the streams and stops when its share "
             "of one runs out: the epoch's length and the samples left out vary with num_workers and world size",
    "all": "every sample of every stream once: the content depends on neither num_workers nor world size",
    "restart": "each reader (rank x DataLoader worker) restarts a stream its share of which ran out, until its share "
               "of every stream ran out once: the repeats vary with num_workers and world size",
}
_MASK = (1 << 64) - 1


def _uniform(key: int, draw: int) -> float:
    """A uniform number in [0, 1) for draw ``draw`` of a stream of draws keyed by ``key`` (splitmix64)."""
    z = (key + (draw + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def _choose(u: float, weights: Sequence[float], active: Sequence[bool]) -> int:
    total = sum(w for w, a in zip(weights, active) if a)
    target = u * total
    last = -1
    for i, (w, a) in enumerate(zip(weights, active)):
        if not a or w <= 0:
            continue
        last = i
        target -= w
        if target < 0:
            return i
    return last  # rounding at the top end


def mix_draws(sources: list[Iterable], weights: Sequence[float], *, key: int, stop: str, position: dict[str, Any],
              set_epoch) -> Iterator[Any]:
    """Items drawn from ``sources``: source ``i`` with probability ``weights[i]`` among those still active.

    ``position`` (``draws``, ``active``, ``exhausted``, ``epochs``, ``taken``) is updated in place
    before every item is yielded, so it always describes where the mix stands. Draw ``d`` depends
    only on ``(key, d)`` and which sources are active, never on the items.
    """
    iterators: list[Iterator | None] = [None] * len(sources)
    active, exhausted = position["active"], position["exhausted"]
    while any(active):
        u = _uniform(key, position["draws"])
        position["draws"] += 1
        i = _choose(u, weights, active)
        if iterators[i] is None:
            iterators[i] = iter(sources[i])
        try:
            item = next(iterators[i])
        except StopIteration:
            exhausted[i] = True
            iterators[i] = None
            if stop == "first":
                active[:] = [False] * len(active)
                return
            if stop == "all" or all(exhausted[j] or weights[j] <= 0 for j in range(len(sources))):
                active[i] = False
                if stop == "restart":
                    active[:] = [False] * len(active)
                continue
            if position["taken"][i] == 0:  # empty even after a restart: restarting again would loop forever
                active[i] = False
                continue
            position["epochs"][i] += 1  # restart
            position["taken"][i] = 0
            set_epoch(i, position["epochs"][i])
            continue
        position["taken"][i] += 1
        yield item


class Mix(SharedEpoch, torch.utils.data.IterableDataset):
    """A weighted interleaving of streams (see ``mix``); ``set_epoch``, ``state_dict``, ``load_state_dict``."""

    def __init__(self, streams: Sequence[Iterable], *, weights: Sequence[float], seed: int = 0, stop: str = "first"):
        streams = list(streams)
        if not streams:
            raise ValueError("mix needs at least one stream")
        weights = [float(w) for w in weights]
        if len(weights) != len(streams):
            raise ValueError(f"got {counted(len(weights), 'weight')} for {counted(len(streams), 'stream')}: "
                             "give one weight per stream")
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights}")
        if stop not in STOP:
            raise ValueError(f"stop must be one of {STOP}, got {stop!r}")
        for i, s in enumerate(streams):
            if callable(getattr(s, "__next__", None)):  # (not iter(s): a ShardStream's iter() fixes a pass)
                raise ValueError(f"stream {i} is an iterator (it can be read only once): pass a re-iterable "
                                 "dataset, e.g. a ShardStream or a list")
        self.streams = streams
        self.weights = weights
        self.seed = seed
        self.stop = stop
        self.epoch = 0
        self._position: dict[str, Any] | None = None
        self._pass_epoch = 0  # the epoch of the pass _position is of (set_epoch may have chosen the next since)
        self._started: list[bool] = []
        self._saved_sources: list = []
        self._logical = 0
        self._num_workers = 0
        self._resume: dict | None = None
        self._generation = 0  # how many elastic resumes this epoch has had (keys the draws)
        self._loaded_shape: dict | None = None
        self._loaded_streams: set[int] = set()  # streams this mix loaded a resume into (see _forget_stream_resumes)

    def set_epoch(self, epoch: int) -> None:
        """The mix's epoch; streams start each epoch at this epoch too (restarts count up from it)."""
        self.epoch = int(epoch)  # persistent workers' copies follow (datapipe.order.shared_epoch)

    def _set_stream_epoch(self, i: int, epoch: int) -> None:
        if callable(getattr(self.streams[i], "set_epoch", None)):
            self.streams[i].set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        """A pass, fixed here, as ``iter()`` is called: its epoch, the loaded resume it takes, each stream's pass at
        its epoch (``iter()`` of every stream with a state, made now), whatever happens to the mix before the pass
        is read (another ``iter()`` at another epoch, without DataLoader workers, too). An error in setting it up
        is raised by the first ``next()``."""
        try:
            return self._pass(*self._plan_pass())
        except Exception as e:  # noqa: BLE001 - raised at the first next(), where torch expects a pass's errors
            return _raising(e)

    def _plan_pass(self) -> tuple:
        """What decides a pass's items: its position, draw key and streams' passes (the loaded resume used up)."""
        self._follow_epoch()  # a persistent worker's copy: the epoch the main process set
        info = torch.utils.data.get_worker_info()
        num_workers = info.num_workers if info is not None else 0
        physical = info.id if info is not None else 0
        self._forget_stream_resumes()
        resume, self._resume = self._resume, None
        if resume is not None and resume.get("epoch", self.epoch) != self.epoch:
            resume = None  # loaded for another epoch (set_epoch since): this one starts afresh, as a ShardStream's
        logical, saved, generation = physical, None, 0
        n = len(self.streams)
        if resume is not None and resume.get("global") is not None:
            g = resume["global"]
            _, world = self._rank_world()
            if g["world_size"] == world and g["num_workers"] == max(1, num_workers):
                resume = self._rank_resume(g["ranks"][self._rank_world()[0]])
            else:
                generation = self._reshape(g)
                resume = None
        if resume is not None:
            if max(1, resume["num_workers"]) != max(1, num_workers):
                raise ValueError(f"mix state was saved with num_workers={resume['num_workers']}, now {num_workers}: "
                                 "resume with the same number of workers, or load the global state "
                                 "(datapipe.order.elastic.merge_states) to resume on another shape")
            logical = (physical + resume["first_worker"]) % max(1, num_workers)
            saved = resume["workers"].get(logical)
            generation = resume["generation"]
        started, saved_sources = [False] * n, [None] * n
        if saved is None:
            position = {"draws": 0, "active": [w > 0 for w in self.weights], "exhausted": [False] * n,
                        "epochs": [self.epoch] * n, "taken": [0] * n, "sources": [None] * n}
            for i in range(n):
                if generation == 0 or resume is not None:
                    self._set_stream_epoch(i, self.epoch)
        else:
            position = {k: (list(v) if isinstance(v, list) else v) for k, v in saved.items()}
            for i, stream in enumerate(self.streams):
                self._set_stream_epoch(i, position["epochs"][i])
                src = position["sources"][i]
                if src is not None:
                    self._load_stream(i, {**src, "first_worker": resume["first_worker"]})
                    saved_sources[i] = src
        for i in range(n):  # unread streams still read the logical worker's share
            if saved is None or position["sources"][i] is None:
                self._logical_share(i, position["epochs"][i], resume)
        premade: dict[int, Iterator] = {}
        where = {"epoch": self.epoch, "position": position, "logical": logical, "num_workers": num_workers,
                 "started": started, "saved_sources": saved_sources, "generation": generation}
        self._enter(where)
        sources = [self._source(i, started, premade, position) for i in range(n)]
        key = (derive_seed(self.seed, self.epoch, logical) if generation == 0 else
               derive_seed(self.seed, self.epoch, logical, self._rank_world()[1], max(1, num_workers), generation))

        def begin(i: int) -> None:  # stream i's pass at the epoch it was just set to, made now
            if callable(getattr(self.streams[i], "state_dict", None)):
                premade[i] = iter(self.streams[i])

        def restart(i: int, epoch: int) -> None:  # a restarted stream reads the logical worker's share too
            self._set_stream_epoch(i, epoch)
            self._logical_share(i, epoch, resume)
            begin(i)

        for i in range(n):
            begin(i)
        return where, sources, key, restart

    def _enter(self, where: dict[str, Any]) -> None:
        """Make ``where`` (a pass's epoch and position) what ``state_dict`` describes: the pass made last, and then
        the one that handed out an item last (passes of one mix may interleave)."""
        self._pass_epoch, self._position, self._logical = where["epoch"], where["position"], where["logical"]
        self._num_workers, self._started = where["num_workers"], where["started"]
        self._saved_sources, self._generation = where["saved_sources"], where["generation"]

    def _pass(self, where: dict[str, Any], sources: list, key: int, restart) -> Iterator[Any]:
        """The items of a pass planned by :meth:`_plan_pass`."""
        position = where["position"]
        for item in mix_draws(sources, self.weights, key=key, stop=self.stop, position=position, set_epoch=restart):
            if self._position is not position:  # another pass of this mix handed out the last item
                self._enter(where)
            yield item

    def _logical_share(self, i: int, epoch: int, resume: dict | None) -> None:
        """Points stream ``i``'s next pass (at ``epoch``) at the logical worker's share from its start, where a
        resume maps this physical worker to another logical one (the stream alone would read the physical's)."""
        if resume is not None and resume["first_worker"] and callable(getattr(self.streams[i], "state_dict", None)):
            self._load_stream(i, {"epoch": epoch, "num_workers": resume["num_workers"], "workers": {},
                                  "first_worker": resume["first_worker"]})

    def _load_stream(self, i: int, state: dict[str, Any]) -> None:
        """Loads ``state`` into stream ``i`` for this pass (it is forgotten as the next pass begins)."""
        self.streams[i].load_state_dict(state)
        self._loaded_streams.add(i)

    def _forget_stream_resumes(self) -> None:
        """(As a pass begins.) The resumes an earlier pass of this object loaded into its streams are spent: a
        stream keeps a loaded resume while it runs in a DataLoader worker (its copy's), so in a persistent
        worker one loaded for an epoch the stream restarted at would redo that resume when a later pass reaches
        that epoch (it would read another worker's share, or from the middle). This pass loads its own."""
        for i in sorted(self._loaded_streams):
            if callable(getattr(self.streams[i], "forget_resume", None)):
                self.streams[i].forget_resume()
        self._loaded_streams.clear()

    def _source(self, i: int, started: list[bool], premade: dict[int, Iterator], position: dict[str, Any]) -> Iterable:
        """Stream ``i`` (its pass made as the mix's pass began or the stream restarted: ``premade``); a stream
        without state resumes by skipping the items it had given."""
        stream = self.streams[i]

        if callable(getattr(stream, "state_dict", None)):
            class _Stateful:
                def __iter__(_):
                    started[i] = True
                    it = premade.pop(i, None)
                    return it if it is not None else iter(stream)

            return _Stateful()

        class _Skip:
            def __iter__(_):
                it = iter(stream)
                for _ in range(position["taken"][i]):
                    next(it, None)
                return it

        return _Skip()

    def state_dict(self) -> dict[str, Any]:
        """Where the mix stands: per worker, its draw count, which streams are live, and each stream's state."""
        workers = {}
        if self._position is not None:
            p = self._position
            sources = []
            for i, s in enumerate(self.streams):
                if p["taken"][i] == 0 and callable(getattr(s, "state_dict", None)) and not self._started[i]:
                    replanned = s.state_dict()  # not read since an elastic resume: keep its new plan
                    sources.append(replanned if int(replanned.get("generation") or 0) else None)
                elif p["taken"][i] == 0 or not callable(getattr(s, "state_dict", None)):
                    sources.append(None)  # fresh (or restarted) stream, or one resumed by skipping
                elif self._started[i]:
                    sources.append(s.state_dict())
                else:
                    sources.append(self._saved_sources[i])  # not read since the resume: still where it was
            workers[self._logical] = {**{k: (list(v) if isinstance(v, list) else v) for k, v in p.items()},
                                      "sources": sources}
        rank, world = self._rank_world()
        epoch = self._pass_epoch if self._position is not None else self.epoch
        return {"kind": "Mix", "epoch": epoch, "seed": self.seed, "weights": list(self.weights),
                "streams": len(self.streams), "num_workers": self._num_workers,
                "workers": workers, "rank": rank, "world_size": world, "generation": self._generation}

    def forget_resume(self) -> None:
        """Drop a loaded resume that worker processes took with their copies (see ``ShardStream.forget_resume``)."""
        self._resume = None

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume: the next iteration of the saved epoch yields exactly its rest (after ``set_epoch`` of another
        epoch, that epoch starts afresh and the resume is dropped, as a ``ShardStream``'s).

        ``state``: this rank's own state, or the global state of all ranks (``datapipe.order.elastic.merge_states``,
        or the list of per-rank states), which resumes on any ranks x workers shape: each stream's
        undelivered samples are planned again over the new shape, and the draws start afresh with
        the same weights (so the mix stays on target over the epoch).
        """
        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(state)
        self.check_loadable(state)
        if elastic.is_global(state):
            self.epoch = int(state["epoch"])
            self._loaded_shape = elastic.shape(state)
            self._resume = {"global": state, "epoch": self.epoch}
            return
        self.epoch = int(state["epoch"])
        if state.get("world_size") is not None:
            self._loaded_shape = {"world_size": int(state["world_size"]),
                                  "num_workers": max(1, int(state["num_workers"]))}
        self._resume = {**self._rank_resume(state), "epoch": self.epoch}

    def check_loadable(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """A ValueError unless ``load_state_dict`` takes ``state`` (this mix is not changed): one naming a
        malformed entry, or each of ``seed``, ``weights``, ``streams`` that differs, with both values."""
        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(state)
        for s in (state["ranks"] if elastic.is_global(state) else [state]):
            check_state(s, "Mix", keys={"epoch": Integral, "num_workers": Integral, "workers": dict})
            check_identity(s, "Mix", {"seed": self.seed, "weights": list(self.weights), "streams": len(self.streams)})

    @staticmethod
    def _rank_resume(state: dict[str, Any]) -> dict[str, Any]:
        return {"num_workers": int(state["num_workers"]), "first_worker": int(state.get("first_worker", 0)),
                "generation": int(state.get("generation", 0)),
                "workers": {int(w): p for w, p in state["workers"].items()}}

    def _rank_world(self) -> tuple[int, int]:
        """The rank and world size of the first stream that sets them (else torch.distributed's)."""
        return rank_world(self)

    def open_ledger(self, num_workers: int, **kw) -> None:
        """(``loaders.DataLoader``, before each pass with workers) each stream's ledger (see ``ShardStream``)."""
        for s in self.streams:
            if callable(getattr(s, "open_ledger", None)):
                s.open_ledger(num_workers, **kw)

    def stats(self) -> dict[str, Any]:
        """The streams' counts added up (those with ``stats()``): skipped, errors, last errors, samples read...;
        ``stop`` and ``epoch_holds`` say what an epoch of this mix holds (see :func:`mix`)."""
        out: dict[str, Any] = {"last_errors": [], "stop": self.stop, "epoch_holds": EPOCH_HOLDS[self.stop]}
        for s in self.streams:
            if not callable(getattr(s, "stats", None)):
                continue
            for k, v in s.stats().items():
                if k == "last_errors":
                    out[k] += v
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        return out

    def _reshape(self, g: dict[str, Any]) -> int:
        """Loads each stream with the global state of its undelivered samples; returns the new generation."""
        world, nw = g["world_size"], g["num_workers"]
        for i, stream in enumerate(self.streams):
            if not callable(getattr(stream, "_rank_world", None)):
                raise ValueError(f"stream {i} is not a ShardStream: only ShardStreams resume a mix on another shape")
            ranks, template = [], None
            for r, rs in enumerate(g["ranks"]):
                workers = {}
                for w, p in rs["workers"].items():
                    if int(p["epochs"][i]) != int(rs["epoch"]):
                        raise ValueError(f"stream {i} restarted in some workers (stop='restart'): this mix "
                                         "state resumes only on the shape it was taken on")
                    src = p["sources"][i]
                    if not any(p["active"]):  # this worker's mix had ended: what it left is not delivered this epoch
                        workers[int(w)] = {"draws": 0, "done": True}
                    elif src is not None:
                        template = template or src
                        workers.update({int(k): dict(v) for k, v in src["workers"].items()})
                ranks.append({"epoch": int(rs["epoch"]), "rank": r, "world_size": world, "num_workers": nw,
                              "workers": workers})
            extra = {k: template[k] for k in ("seed", "shuffle", "shuffle_buffer", "shards", "shard_order", "total",
                                              "generation", "base")
                     if template is not None and k in template}
            self._load_stream(i, elastic.merge_states([{**extra, **rs} for rs in ranks]))
        return 1 + max([int(rs.get("generation", 0)) for rs in g["ranks"]])


def _raising(e: Exception) -> Iterator[Any]:
    raise e
    yield  # a generator: raises at its first next()


def mix(streams: Sequence[Iterable], *, weights: Sequence[float], seed: int = 0, stop: str = "first") -> Mix:
    """Interleave ``streams``, drawing the next item from stream ``i`` with probability ~ ``weights[i]``.

    Deterministic for a given (seed, epoch, world size, num_workers) and resumable (``state_dict`` /
    ``load_state_dict``; streams with state are saved with theirs, others are re-read and skipped). When
    a stream runs out: ``stop="first"`` ends the mix; ``"all"`` goes on with the others (weights
    renormalised) until every stream has run out; ``"restart"`` restarts it (``set_epoch(epoch + 1)`` on
    it when it has one) and ends the epoch once every stream has run out at least once.

    Each reader (rank x DataLoader worker) draws from its own share of every stream, so "runs out" is
    per reader: under ``"first"`` (and ``"restart"``) the epoch's length and which samples it leaves out
    (repeats) depend on ``num_workers`` and the world size, not only on the seed; ``"all"`` delivers
    every sample once on any shape. ``stats()["epoch_holds"]`` says so.
    """
    return Mix(streams, weights=weights, seed=seed, stop=stop)
