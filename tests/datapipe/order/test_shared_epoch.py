"""datapipe.order.shared_epoch: a stream's worker copies follow the epoch the main process sets."""
import pickle

import torch.utils.data

from datapipe.order.shared_epoch import SharedEpoch


class Epoched(SharedEpoch):
    def __init__(self):
        self.epoch = 0
        self.set_calls = []

    def set_epoch(self, epoch):
        self.epoch = int(epoch)
        self.set_calls.append(epoch)
        self._publish_epoch()


def in_worker(monkeypatch, yes: bool):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object() if yes else None)


def test_without_a_cell_nothing_is_shared(monkeypatch):
    s = Epoched()
    s.set_epoch(3)
    in_worker(monkeypatch, True)
    s._follow_epoch()
    assert s.epoch == 3 and s._epoch_cell is None


def test_a_worker_copy_follows_the_main_processes_epoch(monkeypatch):
    main = Epoched()
    main.set_epoch(2)
    main.share_epoch()
    cell = main._epoch_cell
    main.share_epoch()  # idempotent: the same cell
    assert main._epoch_cell is cell and int(cell[0]) == 2 and cell.is_shared()
    copy = pickle.loads(pickle.dumps(main))  # a worker's copy (spawn); torch's pickler keeps the memory shared
    copy._epoch_cell = cell  # as fork and torch's reductions do: the same shared memory
    main.set_epoch(5)
    assert int(cell[0]) == 5
    in_worker(monkeypatch, True)
    copy._follow_epoch()
    assert copy.epoch == 5 and copy.set_calls[-1] == 5
    copy.set_epoch(9)  # a worker never writes the cell: the main process owns the epoch
    assert int(cell[0]) == 5


def test_the_main_process_keeps_its_own_epoch(monkeypatch):
    s = Epoched()
    s.share_epoch()
    s._epoch_cell[0] = 8  # whatever the cell says, the main process's epoch is its attribute
    in_worker(monkeypatch, False)
    s._follow_epoch()
    assert s.epoch == 0 and s.set_calls == []
