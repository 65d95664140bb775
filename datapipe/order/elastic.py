"""Elastic resume: one checkpoint for the whole job, resumable on any ranks x workers shape.

Every per-rank state (``ShardStream``, ``mix``, ``TokenLoader``) names the rank and the shape it was
taken on. ``merge_states`` joins the states of all ranks into one global state (``gather_state``
does it collectively); ``load_state_dict`` of a stage accepts that global state (or the list of
per-rank states) on any shape:

- same ``world_size`` and worker count: each rank takes its own state back (bit-exact resume);
- another shape: the epoch's samples not yet delivered (the unread tail of every worker's run plus
  the samples sitting in its shuffle buffer, found by replaying the buffer's draws over positions)
  are planned again with the epoch plan's rule over those sample numbers (sorted ranges): equal
  contiguous runs per rank (wrapping, at most ``world_size - 1`` repeats), then per worker, read
  through fresh shuffle buffers seeded from (seed, epoch, new shape, resume generation). The next
  epochs follow the new shape's normal plan.
"""
from __future__ import annotations

import logging
import sys
from array import array
from numbers import Integral
from typing import Any, Sequence

from datapipe.order.padding import PADDING_KEYS
from datapipe.order.plan import SHARD_ORDER, Ranges, map_positions, normalize, run_ranges, subtract
from datapipe.order.seeds import derive_seed
from datapipe.order.shuffle import replay_positions
from datapipe.state import check_state
from datapipe.words import counted

log = logging.getLogger("datapipe").getChild("stream")  # what a stream says about its resumes

GLOBAL = "datapipe_global_state"


def is_global(state: Any) -> bool:
    return isinstance(state, dict) and state.get(GLOBAL) == 1


def worker_seed(seed: int, epoch: int, rank: int, worker: int, world_size: int, num_workers: int,
                generation: int) -> int:
    """The seed of a worker's shuffle buffer: the classic one, or one of the shape after an elastic resume."""
    if generation == 0:
        return derive_seed(seed, epoch, rank, worker)
    return derive_seed(seed, epoch, rank, worker, world_size, max(1, num_workers), generation)


def start_of(resume: dict | None, *, worker: int, num_workers: int,
             world_size: int) -> tuple[int, dict[str, Any], Ranges | None, int]:
    """Where physical ``worker`` starts: ``(logical worker, position, base, generation)`` after ``resume``
    (a ShardStream's pending resume, or None: the epoch's start). ``position``: ``draws``, ``done`` and, where
    the saved one has them, the padding's ``last`` and ``owed`` (:mod:`datapipe.order.padding`)."""
    logical, position = worker, {"draws": 0, "done": False}
    base, generation = None, 0
    if resume is None:
        return logical, position, base, generation
    same_workers = max(1, resume["num_workers"]) == max(1, num_workers)  # 0 and 1 worker split alike
    same_world = resume["world_size"] is None or resume["world_size"] == world_size
    if resume.get("reshape") is not None and not (same_workers and same_world):
        return logical, position, resume["reshape"]["base"], resume["reshape"]["generation"]  # elastic: replan
    if not same_workers:
        raise ValueError(f"state was saved with num_workers={resume['num_workers']}, "
                         f"now {num_workers}: resume with the same number of workers, or load the "
                         "global state (datapipe.order.elastic.merge_states) to resume on another shape")
    if not same_world:
        raise ValueError(f"state was saved with world_size={resume['world_size']}, now {world_size}: load the "
                         "global state (datapipe.order.elastic.merge_states) to resume on another shape")
    logical = (worker + resume["first_worker"]) % max(1, num_workers)
    saved = resume["workers"].get(logical, {})
    position = {"draws": int(saved.get("draws", 0)), "done": bool(saved.get("done", False)),
                **{k: int(saved[k]) for k in PADDING_KEYS if saved.get(k) is not None}}
    return logical, position, resume.get("base"), resume.get("generation", 0)


NESTED = ("stream", "dataset", "loader")  # where a loader's state keeps its dataset's (per-rank) state


def inner(state: dict) -> dict:
    """The innermost state that names the rank: the state itself, or its stream's / dataset's / loader's."""
    seen = 0
    while state.get("rank") is None and seen < 4:
        nested = next((state[k] for k in NESTED if isinstance(state.get(k), dict)), None)
        if nested is None:
            break
        state, seen = nested, seen + 1
    return state


def _rank_world(state: dict) -> tuple[int, int]:
    where = inner(state)
    if where.get("rank") is not None and where.get("world_size") is not None:
        return int(where["rank"]), int(where["world_size"])
    raise ValueError("this state names no rank and world_size: take it with this version's state_dict() "
                     "after at least one batch (or load the global state it was resumed from)")


def _fresh(state: Any) -> bool:
    """A state that names no rank because nothing of its epoch was handed out: a loader's state taken after an
    epoch ended or before its first batch (``{"epoch": 1, "batches": 0, "dataset": None, ...}``)."""
    return (isinstance(state, dict) and not is_global(state) and inner(state).get("rank") is None
            and state.get("batches") == 0 and state.get("dataset") is None)


def merge_states(states: Sequence[dict]) -> dict:
    """One global state from the per-rank states of every rank (any order).

    States taken where no rank had handed anything of the epoch out (after an epoch ended) name no
    rank; they merge into the first of them, which starts that epoch on any shape.
    """
    if is_global(states):
        return states
    states = list(states)
    if not states:
        raise ValueError("merge_states needs the state of every rank, got none")
    if all(is_global(s) for s in states):  # every rank still holds the global state it loaded
        if len({(s["world_size"], s["num_workers"], s["epoch"]) for s in states}) == 1:
            return states[0]
    fresh = [_fresh(s) for s in states]
    if any(fresh):
        epochs = sorted({int(_field(s, "epoch") or 0) for s in states})
        if all(fresh) and len(epochs) == 1:
            return dict(states[0])  # no rank had handed out anything of this epoch: its start, on any shape
        raise ValueError(f"the rank states disagree: ranks {[i for i, f in enumerate(fresh) if f]} had handed out "
                         f"nothing of their epoch, the others had (epochs {epochs}); take the states at a step every "
                         "rank has reached")
    by_rank: dict[int, dict] = {}
    world = None
    for s in states:
        if is_global(s):
            raise ValueError("merge_states takes per-rank states, got a global state among them")
        rank, w = _rank_world(s)
        if world is not None and w != world:
            raise ValueError(f"states come from different world sizes ({world} and {w})")
        world = w
        if rank in by_rank:
            raise ValueError(f"two states for rank {rank}")
        by_rank[rank] = s
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        raise ValueError(f"states of ranks {missing} are missing: merge the states of all {world} ranks")
    ranks = [by_rank[r] for r in range(world)]
    return {GLOBAL: 1, "world_size": world, "num_workers": max(_num_workers(s) for s in ranks),
            "epoch": _field(ranks[0], "epoch"), "ranks": ranks}


def _num_workers(state: dict) -> int:
    return max(1, int(inner(state).get("num_workers", 0) or 0))


def _field(state: dict, key: str):
    if key in state:
        return state[key]
    return inner(state).get(key)


def shape(state: dict | Sequence[dict]) -> dict:
    """``{"world_size", "num_workers"}`` a state (per-rank, global, or a list) was taken on."""
    if isinstance(state, (list, tuple)):
        state = merge_states(state)
    if is_global(state):
        return {"world_size": state["world_size"], "num_workers": state["num_workers"]}
    _, world = _rank_world(state)
    return {"world_size": world, "num_workers": _num_workers(state)}


def gather_state(obj) -> dict:
    """The global state of ``obj`` (anything with ``state_dict()``, or a per-rank state) over all ranks.

    A collective when torch.distributed is initialised (every rank must call it; every rank gets
    the global state), else the state of this one process (which must be the whole job).
    """
    state = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)
        return merge_states(states)
    return merge_states([state])


# ---- ShardStream states ------------------------------------------------------------------------
def pack_ranges(ranges: Ranges) -> bytes:
    """Ranges as little-endian int64 pairs: a state carries them with every batch, and bytes pickle in one copy."""
    a = array("q", [x for r in ranges for x in r])
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ranges(data) -> tuple[tuple[int, int], ...]:
    """Ranges from ``pack_ranges`` bytes, or from a list of ``(start, stop)`` pairs."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        a = array("q")
        a.frombytes(bytes(data))
        if sys.byteorder == "big":
            a.byteswap()
        return tuple(zip(a[0::2], a[1::2]))
    return tuple((int(lo), int(hi)) for lo, hi in data)


def base_of(state: dict, total: int) -> tuple[tuple[int, int], ...]:
    """The global sample numbers a state's epoch plan ran over (all of the epoch unless resumed elastically)."""
    base = state.get("base")
    if base is None:
        if int(state.get("generation", 0)):
            raise ValueError("state of an elastically resumed epoch lacks its 'base' ranges")
        return ((0, total),) if total else ()
    return unpack_ranges(base)


def delivered(state: dict, *, total: int, shuffle_buffer: int) -> list[tuple[int, int]]:
    """Global sample numbers that the workers of one rank state have handed out (sorted ranges)."""
    rank, world = _rank_world(state)
    nw = _num_workers(state)
    gen = int(state.get("generation", 0))
    base = base_of(state, total)
    epoch, seed = int(state["epoch"]), int(state.get("seed", 0))
    shuffle_buffer = int(state.get("shuffle_buffer", shuffle_buffer))
    if state.get("total") is not None and int(state["total"]) != total:
        raise ValueError(f"state was taken over {state['total']} samples per epoch, these shards hold {total}")
    out: list[tuple[int, int]] = []
    for key, pos in state.get("workers", {}).items():
        worker = int(key)
        ranges, _ = run_ranges(base, rank=rank, world_size=world, worker=worker, num_workers=nw)
        length = sum(b - a for a, b in ranges)
        draws = int(pos.get("draws", 0))
        if pos.get("done"):
            out.extend(ranges)
            continue
        if draws == 0:
            continue
        if shuffle_buffer <= 1:
            positions = [(0, draws)]
        else:
            buffer, pulled = replay_positions(shuffle_buffer, worker_seed(seed, epoch, rank, worker, world, nw, gen),
                                              length, draws)
            positions = subtract([(0, pulled)], normalize((p, p + 1) for p in buffer.slots))
        out.extend(map_positions(ranges, positions))
    return normalize(out)


def remaining(global_state: dict, *, total: int, shuffle_buffer: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The epoch's sample numbers no rank has handed out (sorted ranges), and the state's generation."""
    ranks = global_state["ranks"]
    gens = {int(s.get("generation", 0)) for s in ranks}
    epochs = {int(s["epoch"]) for s in ranks}
    if len(gens) != 1 or len(epochs) != 1:
        raise ValueError(f"rank states disagree on the epoch {sorted(epochs)} or resume generation {sorted(gens)}")
    base = normalize(base_of(next((s for s in ranks if s.get("base") is not None), ranks[0]), total))
    done: list[tuple[int, int]] = []
    for s in ranks:
        done.extend(delivered(s, total=total, shuffle_buffer=shuffle_buffer))
    return tuple(subtract(base, normalize(done))), gens.pop()


# ---- delivered bitmaps (ImageLoader's DALI reader) ---------------------------------------------
def pack_bitmap(mask) -> bytes:
    """A per-epoch bool array of delivered global sample numbers, packed 8 per byte (``np.packbits``)."""
    import numpy as np

    return np.packbits(np.asarray(mask, dtype=bool)).tobytes()


def unpack_bitmap(data, total: int):
    """The bool array of ``pack_bitmap`` bytes over ``total`` samples; a clear ValueError when it does not fit."""
    import numpy as np

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"the delivered bitmap must be bytes (np.packbits), got {type(data).__name__}")
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    if raw.size != (total + 7) // 8:
        raise ValueError(f"the delivered bitmap holds {raw.size} bytes, an epoch of {total} samples needs "
                         f"{(total + 7) // 8}: a corrupt state, or one of other shards")
    mask = np.unpackbits(raw, count=None)[: raw.size * 8].astype(bool)
    if mask[total:].any():
        raise ValueError("the delivered bitmap marks samples past the epoch's end: a corrupt state")
    return mask[:total]


def mask_ranges(mask) -> list[tuple[int, int]]:
    """The sorted ``(start, stop)`` ranges of the True entries of a bool array."""
    import numpy as np

    m = np.concatenate(([False], np.asarray(mask, dtype=bool), [False])).view(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def planned_state(remaining: Ranges, *, epoch: int, seed: int, world_size: int, total: int,
                  shuffle_buffer: int, generation: int = 0) -> dict:
    """A global ShardStream state taken on ``world_size`` ranks whose undelivered samples are ``remaining``.

    Loading it on another shape plans exactly those sample numbers over the new shape (the rule
    above), at generation ``generation + 1``: how a reader that records deliveries another way
    (a bitmap) hands its rest of the epoch to ShardStream.
    """
    base = pack_ranges(normalize(remaining))
    ranks = [{"epoch": int(epoch), "seed": int(seed), "world_size": int(world_size), "rank": r, "num_workers": 0,
              "workers": {}, "shuffle_buffer": int(shuffle_buffer), "total": int(total),
              "shard_order": SHARD_ORDER, "generation": int(generation), "base": base} for r in range(int(world_size))]
    return {GLOBAL: 1, "world_size": int(world_size), "num_workers": 1, "epoch": int(epoch), "ranks": ranks}


def say_replanned(saved: dict | None, *, rank: int, world: int, worker: int, num_workers: int) -> None:
    """One INFO line (rank 0's first worker) when a resume is planned again over another shape: the rest of the
    epoch comes in another order than an uninterrupted run's (docs/guarantees.md, Resume)."""
    if rank != 0 or worker != 0 or saved is None:
        return
    if saved["world_size"] == world == 1:
        log.info("resuming a state of %s with %d: the rest of the epoch comes exactly once, in another order",
                 counted(saved["num_workers"], "worker"), num_workers)
    else:
        log.info("resuming a state of %d ranks x %d workers on %d x %d: the rest of the epoch comes in another "
                 "order, every sample of it delivered (a few twice, to keep the ranks even)",
                 saved["world_size"], saved["num_workers"], world, max(1, num_workers))


def check_stream_state(state: Any) -> None:
    """A ValueError naming what is wrong unless ``state`` has the keys and value types of a ShardStream state."""
    check_state(state, "ShardStream", keys={"epoch": Integral, "num_workers": Integral, "workers": dict})
    for worker, position in state["workers"].items():
        if not (isinstance(position, dict) and isinstance(position.get("draws", 0), Integral)
                and all(isinstance(position.get(k, 0), (Integral, type(None))) for k in PADDING_KEYS)):
            raise ValueError(f"not a ShardStream state: worker {worker!r}'s position is {position!r:.60}, expected "
                             "{'draws': int, 'done': bool}; pass what ShardStream.state_dict() returned")
