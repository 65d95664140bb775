"""loaders.DataLoader's forked workers never finalise an object of the parent (datapipe.device.forks): here a
stand-in for a CUDA batch in an uncollected reference cycle, whose destructor notes the process it ran in (a
real one aborts a worker: 'CUDA error: initialization error' in a tensor's destructor)."""
import functools
import gc
import os

import pytest

from loaders import DataLoader
from tests.loaders.dataloader import test_deaths as d
from tests.loaders.toy_datasets import Squares

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class DeviceBatch:
    """Holds a batch in a reference cycle; freed in another process than its maker's, it leaves a file."""

    def __init__(self, batch, directory):
        self.batch, self.directory, self.me, self.pid = batch, directory, self, os.getpid()

    def __del__(self):
        if os.getpid() != self.pid:
            with open(os.path.join(self.directory, f"freed-in-{os.getpid()}"), "w"):
                pass


def _collect(worker_id):
    gc.collect()  # what any allocation in the worker may start (torch's seeding, the dataset, the collate)


def _freed_in_children(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("freed-in-"))


def _validation_pass():
    val = DataLoader(Squares(), batch_size=4, num_workers=2, worker_init_fn=_collect)
    assert len(list(val)) > 0
    val.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", [False, True])
def test_a_training_loader_alive_while_a_validation_loader_starts_its_workers(tmp_path, frozen):
    """Training holds batches (and drops some into cycles) while validation forks workers; a script may have
    frozen its collector after the imports (docs/performance.md)."""
    if frozen:
        gc.freeze()
    train = DataLoader(d.Stamped(), batch_size=8, num_workers=2, collate_fn=d.samples, device="cpu")
    try:
        it = iter(train)
        held = [next(it) for _ in range(3)]
        for batch in held:
            DeviceBatch(batch, str(tmp_path))  # garbage now, in a cycle
        _validation_pass()
        held.append(next(it))
        assert _freed_in_children(tmp_path) == []
    finally:
        train.close()
        if frozen:
            gc.unfreeze()
    gc.collect()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", [False, True])
def test_after_a_pass_ended_by_a_killed_worker_a_new_loaders_workers_free_nothing_of_it(tmp_path, frozen):
    """The order the GPU tests found: a pass whose worker was killed, its batches left in cycles, then a new
    loader starts workers."""
    if frozen:
        gc.freeze()
    pids = tmp_path / "pids"
    pids.mkdir()
    try:
        dl = DataLoader(d.Stamped(), batch_size=8, num_workers=2, collate_fn=d.samples, device="cpu",
                        worker_init_fn=functools.partial(d._note_pid, str(pids)))
        taken = []

        def check(batch, n):
            d._check_stamped(batch, n)
            taken.append(batch)

        _, it, n = d._run_until_a_worker_dies(dl, pids, check)
        d._the_pass_ends(it, n, check)
        dl.close()
        for batch in taken:
            DeviceBatch(batch, str(tmp_path))
        del taken, it, dl
        _validation_pass()
        assert _freed_in_children(tmp_path) == []
    finally:
        if frozen:
            gc.unfreeze()
    gc.collect()
