"""Small datasets and helpers shared by the tests of ``loaders.DataLoader`` (tests/loaders/dataloader/)."""
import gc
import multiprocessing
import threading
import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


N = 22


class Squares(Dataset):
    """Map-style; remembers which indices it loaded (in the main process)."""

    def __init__(self, n=N, fail_at=None):
        self.n = n
        self.fail_at = fail_at
        self.loaded = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise RuntimeError(f"cannot read sample {i}")
        self.loaded.append(i)
        return {"x": torch.tensor([i, i * i]), "i": i, "name": f"s{i}"}


class Counting(IterableDataset):
    """Plain iterable dataset split over workers (no state protocol)."""

    def __init__(self, n=N):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        w, k = (info.num_workers, info.id) if info else (1, 0)
        for i in range(k, self.n, w):
            yield torch.tensor([i, -i])


class ToyStream(IterableDataset):
    """Stateful stream implementing the worker-state protocol.

    Logical worker ``l`` of ``W`` reads shards ``l, l + W, ...`` (unequal lengths), physical worker
    ``p`` plays logical worker ``(p + first_worker) % W``. Position = (shard, offset, done).
    """

    def __init__(self, shards):
        self.shards = shards
        self.epoch = 0
        self._resume = None
        self._w, self._l, self._pos = 1, 0, {"shard": 0, "offset": 0, "done": False}

    def set_epoch(self, epoch):
        self.epoch = epoch

    def load_state_dict(self, state):
        self._resume = {**state, "workers": {int(k): dict(v) for k, v in state["workers"].items()}}

    def state_dict(self):
        return {"epoch": self.epoch, "num_workers": self._w, "workers": {self._l: dict(self._pos)}}

    def __iter__(self):
        info = get_worker_info()
        w, p = (info.num_workers, info.id) if info else (1, 0)
        resume = self._resume if self._resume and self._resume["epoch"] == self.epoch else None
        if resume is not None and resume["num_workers"] != w:
            raise ValueError(f"state saved with num_workers={resume['num_workers']}, running with {w}")
        first = resume["first_worker"] if resume else 0
        self._w, self._l = w, (p + first) % w
        start = (resume or {"workers": {}})["workers"].get(self._l, {"shard": 0, "offset": 0, "done": False})
        self._pos = dict(start)
        if start["done"]:
            return
        mine = self.shards[self._l::w]
        s, o = start["shard"], start["offset"]
        while s < len(mine):
            while o < len(mine[s]):
                x = mine[s][o]
                o += 1
                self._pos = {"shard": s, "offset": o, "done": False}
                yield torch.tensor(x + 1000 * self.epoch)
            s, o = s + 1, 0
        self._pos = {"shard": s, "offset": 0, "done": True}


SHARDS = [list(range(0, 9)), [10, 11], list(range(20, 24)), [30], list(range(40, 43)), list(range(50, 56))]


def plain(batch):
    """Comparable form of a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return ("T", str(batch.dtype), batch.tolist())
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(plain(v) for v in batch)
    return batch


def run(loader, limit=None):
    out = []
    for b in loader:
        out.append(plain(b))
        if limit is not None and len(out) == limit:
            break
    return out


def children_gone(timeout=15.0):
    """No worker process left. Garbage is collected first: an iterator an earlier test abandoned (kept in a
    reference cycle, as torch's are) shuts its workers down only when collected."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return multiprocessing.active_children() == []


def threads_gone(timeout=10.0):
    deadline = time.monotonic() + timeout
    alive = lambda: [t for t in threading.enumerate() if t.name == "datapipe-prefetch" and t.is_alive()]  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive() == []
