"""The worker-state protocol of ``loaders.DataLoader``: how an iterable dataset's position leaves torch's
workers with every batch and goes back into the dataset on resume. (The one place it is written down.)

A dataset takes part when it is a ``torch.utils.data.IterableDataset`` with ``state_dict()`` and
``load_state_dict()`` (``ShardStream``, ``mix``; see :mod:`datapipe.state`):

1. Out of a worker. The loader wraps ``collate_fn`` (:class:`StatefulCollate`) so that each batch
   leaves its worker as ``(batch, WorkerMeta(worker_id, dataset.state_dict()))``: the physical worker
   id and the state of that worker's copy of the dataset after the batch's samples
   (``num_workers=0``: worker 0 and the main process's dataset).
2. A worker's state is a dict with ``"epoch"``, ``"num_workers"`` (the worker count the dataset
   planned the epoch for) and ``"workers"``: ``{logical_worker: position}``. Its other keys (``rank``,
   ``world_size``, ``seed``, ``shuffle_buffer``, ``total``, ``generation``, ``base``...: what an
   elastic resume needs) are passed through untouched.
3. In the main process, as batches are handed out (:class:`WorkerStates`): the ``"workers"``
   entries are merged, the other keys come from the latest state, and the next logical worker is
   the one after the worker of the latest batch (physical ``p`` is logical ``(p + first) % n``).
4. The loader's ``state_dict()`` carries the merge under ``"dataset"``:
   ``{**latest_worker_state, "epoch", "num_workers", "workers": {...}, "first_worker": k}``.
5. On resume the dataset receives that dict through ``load_state_dict`` before the resumed epoch
   and maps physical worker ``p`` to logical worker ``(p + k) % num_workers``: the first batch
   comes from the worker whose turn was next. Exact with any worker count, exhausted workers
   included, because torch's round-robin over active workers depends only on each worker's
   stream. Not exact with ``in_order=False``.
6. A global state (:mod:`datapipe.order.elastic`) under ``"dataset"`` goes to ``load_state_dict``
   unchanged (the dataset replans the epoch's rest over the new shape); until the first batch of
   the resumed run, the loader's ``state_dict()`` returns the global state it was given.
7. Once a resumed pass's workers have started (they took the resume with their copies), the loader calls
   the dataset's ``forget_resume()`` where it has one: another pass over the same dataset object (another
   loader's, or this one's next) is a whole epoch. As the next pass of this loader begins it calls it again (a
   resumed pass without workers leaves the resume in the dataset until its first sample: a pass never read keeps
   it) and starts new persistent workers (their copies started with it): the resumed pass had it, read or not.
"""
from __future__ import annotations

from torch.utils.data import IterableDataset, get_worker_info

from datapipe.order import elastic

__all__ = ["WorkerMeta", "StatefulCollate", "WorkerStates", "has_protocol"]


def has_protocol(dataset) -> bool:
    """Whether ``dataset`` takes part in the worker-state protocol."""
    return isinstance(dataset, IterableDataset) and callable(getattr(dataset, "state_dict", None)) \
        and callable(getattr(dataset, "load_state_dict", None))


class WorkerMeta:
    """What travels with a batch out of a worker (step 1): physical worker id and the dataset's state."""

    __slots__ = ("worker_id", "state")

    def __init__(self, worker_id: int, state: dict):
        self.worker_id = worker_id
        self.state = state


class StatefulCollate:
    """collate_fn wrapper (step 1): returns ``(batch, WorkerMeta(worker_id, dataset.state_dict()))``."""

    def __init__(self, collate, dataset):
        self.collate = collate
        self._dataset = dataset  # used only in the main process (num_workers=0)

    def __getstate__(self):
        return {"collate": self.collate, "_dataset": None}

    def __call__(self, samples):
        batch = self.collate(samples)
        info = get_worker_info()
        if info is None:
            return batch, WorkerMeta(0, self._dataset.state_dict())
        return batch, WorkerMeta(info.id, info.dataset.state_dict())


class WorkerStates:
    """The worker states of one pass, merged in the main process (step 3); the dataset's part of the
    loader's state (step 4); a saved one taken back (steps 5 and 6)."""

    def __init__(self, num_workers: int):
        self.workers: dict = {}
        self.first_worker = 0  # logical worker of physical worker 0 in this run
        self.next_worker = 0
        self.epoch = None
        self.num_workers = max(1, num_workers)
        self.last: dict | None = None  # the last worker state seen (rank, shape, seed, plan basis...)
        self.resumed_from: dict | None = None  # a global state loaded, until this pass's first batch
        self.start: dict | None = None  # the dataset's state as the pass began (resume.epoch_start), until a batch

    def note(self, meta: WorkerMeta) -> None:
        """Merge the state that came with a batch just handed out."""
        state = meta.state
        n = max(1, int(state.get("num_workers", self.num_workers)))
        self.num_workers = n
        self.epoch = state.get("epoch", self.epoch)
        self.last = state
        self.workers.update(state.get("workers", {}))
        logical = (meta.worker_id + self.first_worker) % n
        self.next_worker = (logical + 1) % n

    def resume(self, loader_state: dict) -> dict:
        """Take back the ``"dataset"`` part of a loader state; returns it, for the dataset's ``load_state_dict``."""
        ds = loader_state["dataset"]
        if elastic.is_global(ds):  # replanned over this shape: the workers start their new runs
            self.resumed_from = loader_state.get("global") or loader_state
        else:
            self.workers = dict(ds.get("workers", {}))
            self.first_worker = self.next_worker = int(ds.get("first_worker", 0))
            self.num_workers = max(1, int(ds.get("num_workers", 1)))
            self.last = {k: v for k, v in ds.items() if k not in ("workers", "first_worker")}
        self.epoch = ds.get("epoch")
        return ds

    def loaded_global(self) -> dict | None:
        """The global state this pass resumed from, while none of its batches has been handed out."""
        return self.resumed_from if self.last is None else None

    def dataset_state(self, epoch: int) -> dict:
        """The ``"dataset"`` part of the loader's state (step 4); ``epoch``: the pass's, if no worker said."""
        # every key of the last worker state (rank, world_size, seed, shuffle_buffer, total,
        # generation, base: what an elastic resume needs), the merged worker positions on top; before the
        # first batch the dataset's state at the pass's start: the rank has delivered nothing of the epoch yet
        return {**(self.last or self.start or {}), "epoch": self.epoch if self.epoch is not None else epoch,
                "num_workers": self.num_workers, "workers": dict(self.workers),
                "first_worker": self.next_worker}
