"""The state of ``loaders.DataLoader`` (:mod:`datapipe.state`): its shape, how it is assembled and checked,
and the map-style resume (the index sampler that replays the order and skips consumed batches).

A loader state is ``{"kind": "DataLoader", "epoch", "batches", "num_workers", "generator_state",
"rng_state", "sampler_rng_state", "sampler_generator_state", "sampler_epoch", "base_seed", "dataset"}``:

- ``epoch`` / ``batches``: the pass and the batches handed out in it (failed ones included);
  ``num_workers``: the worker count the pass ran with.
- map-style datasets: ``generator_state`` (the generator's state before the pass),
  ``rng_state`` (torch's global RNG before torch's iterator was made: the workers' base seed) and
  ``sampler_rng_state`` (the global RNG before the sampler's first draw, where ``RandomSampler``
  draws its seed) and ``sampler_generator_state`` (the loader's generator before the sampler's first draw:
  a pass over persistent workers draws no base seed from it first, a resumed one does) let the resumed pass
  regenerate the same sampler order; the consumed batches are
  skipped in the index sampler, never loaded. ``sampler_epoch`` (e.g. a ``DistributedSampler``'s)
  is restored. Per-sample randomness inside workers is not replayed: after a resume batch ``n``
  runs on worker 0, not on worker ``n % num_workers``.
- iterable datasets with the worker-state protocol: ``dataset`` holds the merged worker states
  (:mod:`loaders.dataloader.workers`), or a global state (:mod:`datapipe.order.elastic`).
- other iterable datasets: ``dataset`` is None; the consumed batches are produced again and dropped
  (exact only for a dataset that replays the same stream for the same epoch and worker count).

A finished pass, none yet, or ``set_epoch`` since the pass began gives the state of the start of the loader's next
pass (``batches`` 0; the generator and the sampler's epoch as that pass will find them).
"""
from __future__ import annotations

import weakref

import torch

from datapipe.order import elastic
from datapipe.order.ranks import rank_world  # (rank, world_size) as the dataset (or its stream) sees them
from datapipe.state import check_state

__all__ = ["KIND", "RngRecord", "Plan", "IndexSampler", "fresh_state", "pass_state", "as_loadable", "skip_base_seed",
           "check_local", "from_global", "rank_world", "record_order", "epoch_start"]

KIND = "DataLoader"  # the "kind" of its states (datapipe.state)

_END = object()


class RngRecord:
    """What one pass drew its randomness from, recorded so that a resume can draw it again."""

    def __init__(self):
        self.generator_state = None
        self.rng_state = None  # global RNG before the torch iterator was made (base seed)
        self.sampler_rng = None  # global RNG before the sampler's first draw
        self.sampler_generator = None  # the loader's generator before the sampler's first draw
        self.sampler_epoch = None
        self.base_seed = None

    def restore(self, state: dict) -> None:
        """Take the recorded RNG states of a saved loader state back."""
        self.generator_state = state.get("generator_state")
        self.rng_state = state.get("rng_state")
        self.sampler_rng = state.get("sampler_rng_state")
        self.sampler_generator = state.get("sampler_generator_state")


class Plan:
    """How the next ``iter()`` of the index sampler runs: batches to skip, the global RNG's and the loader's
    generator's states to replay, the record that notes them as the sampler's first draw finds them, and the gate
    its pulls go through (:mod:`loaders.dataloader.end_gate`)."""

    __slots__ = ("skip", "replay", "record", "replay_generator", "gate")

    def __init__(self, skip=0, replay=None, record: RngRecord | None = None, replay_generator=None, gate=None):
        self.skip, self.replay, self.record, self.replay_generator = skip, replay, record, replay_generator
        self.gate = gate  # the pass's loaders.dataloader.end_gate.EndGate, or None


class IndexSampler:
    """The loader's ``_index_sampler``: torch's, skipping consumed batches and recording/replaying
    the global RNG state of its first draw (where ``RandomSampler`` draws its seed). ``loader._plan``
    says how the next ``iter()`` runs."""

    def __init__(self, loader, inner):
        self._loader = weakref.ref(loader)
        self.inner = inner

    def __iter__(self):
        loader = self._loader()  # torch may call iter() twice while making one iterator
        plan = loader._plan if loader is not None else Plan()
        generator = getattr(loader, "generator", None)
        if plan.gate is None:
            return self._run(iter(self.inner), plan, generator, plan.skip)
        # the gate skips the batches itself: the draws of the pass's own first pull are then told from theirs
        return plan.gate.pulls(self._run(iter(self.inner), plan, generator, 0), first=plan.skip + 1,
                               workers=loader.num_workers, prefetch_factor=loader.prefetch_factor)

    @staticmethod
    def _run(it, plan: Plan, generator, skip: int):
        if generator is not None and plan.replay_generator is not None:
            generator.set_state(plan.replay_generator)
        elif generator is not None and plan.record is not None:
            plan.record.sampler_generator = generator.get_state()
        if plan.replay is not None:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(plan.replay)
                first = next(it, _END)
        else:
            if plan.record is not None:
                plan.record.sampler_rng = torch.get_rng_state()
            first = next(it, _END)
        if first is _END:
            return
        if skip == 0:
            yield first
        for _ in range(skip - 1):
            if next(it, _END) is _END:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)


def skip_base_seed(generator: torch.Generator | None) -> None:
    """Draw from ``generator`` (None: nothing) what a new torch iterator draws for its workers' base seed (a pass
    over persistent workers resets theirs, which draws none): with ``seed=`` the order is then ``seed + epoch``'s
    alone, and a resumed state meets the generator as it was saved, whatever ran before."""
    if generator is not None:
        torch.empty((), dtype=torch.int64).random_(generator=generator)


def fresh_state(epoch: int, num_workers: int, generator_state=None, sampler_generator_state=None,
                sampler_epoch: int | None = None) -> dict:
    """The state of the start of ``epoch``; ``generator_state``: the loader's generator as that pass will find it
    (``sampler_generator_state`` too where the pass reuses persistent workers, and draws no base seed first);
    ``sampler_epoch``: the sampler's epoch that pass will run at (a ``DistributedSampler``'s; None: it has none)."""
    return {"kind": KIND, "epoch": epoch, "batches": 0, "num_workers": num_workers,
            "generator_state": generator_state, "rng_state": None, "sampler_rng_state": None,
            "sampler_generator_state": sampler_generator_state, "sampler_epoch": sampler_epoch, "base_seed": None,
            "dataset": None}


def epoch_start(dataset, epoch: int) -> dict:
    """The dataset's state as a pass at ``epoch`` begins (its kind, rank, shape and what it was taken over), the
    ``"dataset"`` part of the loader's state until the pass's first batch; a plan of another epoch is dropped."""
    state = dict(dataset.state_dict())
    if state.get("epoch") != epoch:
        state.update({k: v for k, v in (("generation", 0), ("base", None)) if k in state})
    return state


def pass_state(p, *, protocol: bool) -> dict:
    """The state of the running pass ``p`` (a ``dataloader_progress.Progress``)."""
    loaded = p.workers.loaded_global()
    if loaded is not None:  # a global state loaded, no batch since
        return dict(loaded)
    ds = p.workers.dataset_state(p.epoch) if protocol else None
    rng = p.rng
    return {"kind": KIND, "epoch": p.epoch, "batches": p.batches, "num_workers": p.num_workers,
            "generator_state": rng.generator_state, "rng_state": rng.rng_state,
            "sampler_rng_state": rng.sampler_rng, "sampler_generator_state": rng.sampler_generator,
            "sampler_epoch": rng.sampler_epoch,
            "base_seed": rng.base_seed, "dataset": ds}


def as_loadable(state, *, protocol: bool, fixed_workers: int | None):
    """``state`` as ``load_state_dict`` takes it: a list of rank states becomes their global state, and
    so does the state of one rank that was the whole job, saved with another worker count than
    ``fixed_workers`` (None: ``num_workers="auto"``), which then resumes on this worker count."""
    if isinstance(state, (list, tuple)):
        state = elastic.merge_states(list(state))
    ds = state.get("dataset") if isinstance(state, dict) else None
    if not elastic.is_global(state) and protocol and isinstance(ds, dict) and not elastic.is_global(ds) \
            and ds.get("world_size") == 1 and ds.get("rank") == 0 and fixed_workers is not None \
            and max(1, int(state.get("num_workers", 0))) != max(1, fixed_workers):
        state = elastic.merge_states([state])  # one rank was the whole job: resume it on this worker count
    return state


def check_local(state, *, iterable: bool, fixed_workers: int | None) -> None:
    """A ValueError unless ``state`` is a loader state this loader resumes (``fixed_workers``: its
    worker count, None under ``num_workers="auto"``)."""
    ds = state.get("dataset") if isinstance(state, dict) else None
    check_state(state, KIND)
    missing = {"epoch", "batches", "num_workers"} - set(state)
    if missing:
        raise ValueError(f"not a loaders.DataLoader state (missing {sorted(missing)}); pass what state_dict() returned")
    saved_w = int(state["num_workers"])
    if fixed_workers is not None and iterable and state["batches"] > 0 \
            and max(1, saved_w) != max(1, fixed_workers) and not elastic.is_global(ds):
        raise ValueError(
            f"state was saved with num_workers={saved_w}, this loader has num_workers={fixed_workers}: "
            "an iterable dataset's per-worker streams only resume with the same worker count; "
            "global states (global_state_dict(), or the list of every rank's state_dict()) resume on any")


def from_global(state: dict, *, rank: int, world_size: int, fixed_workers: int | None,
                workers_now: int) -> tuple[dict, bool]:
    """What this rank loads from a global state: ``(loader_state, replanned)``.

    On the same shape (``world_size``, and the worker count unless ``fixed_workers`` is None) the
    rank's own state (bit-exact); if no rank had handed anything out, the epoch from its start;
    else a state whose ``dataset`` is the global state of the datasets, which the dataset replans
    over this shape (``replanned``: the loader reports the global state until its first batch).
    """
    ranks = state["ranks"]
    saved_w = {max(1, int(r["num_workers"])) for r in ranks}
    if world_size == state["world_size"] and (fixed_workers is None or saved_w == {max(1, fixed_workers)}):
        own = {k: v for k, v in ranks[rank].items() if k not in ("rank", "world_size")} \
            if ranks[rank].get("dataset") is None else ranks[rank]
        return own, False  # the same shape: bit-exact
    datasets = [r.get("dataset") for r in ranks]
    if all(d is None for d in datasets):  # nobody had handed anything out: the epoch from its start
        return {"epoch": int(state["epoch"]), "batches": 0, "num_workers": workers_now}, False
    if any(d is None for d in datasets):
        raise ValueError("the rank states of this global state disagree: some ranks had finished or not started "
                         "the epoch; take the global state at a step every rank has reached")
    ds = elastic.merge_states(datasets)
    return {"epoch": int(state["epoch"]), "batches": 0, "num_workers": workers_now,
            "generator_state": None, "rng_state": None, "sampler_rng_state": None, "sampler_generator_state": None,
            "sampler_epoch": None, "base_seed": None, "dataset": ds}, True


def record_order(rng: RngRecord, resume: dict | None, *, sampler, generator) -> None:
    """Into ``rng``, a pass's: the generator's state and the sampler's epoch, or a pending resume's put
    back (its RNG states, and its sampler epoch given to the sampler)."""
    if resume is not None:
        rng.restore(resume)
        if resume.get("sampler_epoch") is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(resume["sampler_epoch"])
    elif generator is not None:
        rng.generator_state = generator.get_state()
    rng.sampler_epoch = getattr(sampler, "epoch", None)
