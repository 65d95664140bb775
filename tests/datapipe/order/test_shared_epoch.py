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


def test_each_pass_begun_is_a_fresh_epoch_unless_one_was_set():
    s = Epoched()
    assert s.next_pass_epoch() == 0 and s.begin_pass() == 0
    assert [s.begin_pass() for _ in range(3)] == [1, 2, 3]  # the one after the last pass begun
    s.set_epoch(1)  # a choice: the next pass runs at it, those after count on from it
    assert s.next_pass_epoch() == 1 and s.begin_pass() == 1 and s.begin_pass() == 2
    s.epoch = 7  # any assignment (a load_state_dict) is a choice too
    assert s.begin_pass() == 7
    assert s.begin_pass(4) == 4 and s.epoch == 4 and s.next_pass_epoch() == 5  # a loader's own choice
    s.set_epoch(5)  # the same epoch the count would give: still one pass at it, then on
    assert s.begin_pass() == 5 and s.begin_pass() == 6


def test_begin_pass_reaches_worker_copies(monkeypatch):
    s = Epoched()
    s.share_epoch()
    s.begin_pass(), s.begin_pass()
    assert int(s._epoch_cell[0]) == 1
