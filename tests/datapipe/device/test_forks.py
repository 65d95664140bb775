import gc
import os

import pytest

from datapipe.device import forks

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class _Cyclic:
    """Garbage in a reference cycle whose destructor says, through a pipe, in which process it ran."""

    def __init__(self, fd: int):
        self.fd = fd
        self.me = self

    def __del__(self):
        os.write(self.fd, b"C" if os.getpid() != PARENT else b"P")


PARENT = os.getpid()


def _fork_and_collect() -> bytes:
    """A cycle is dropped, then a child forks and runs the collector; what its destructor reported."""
    read, write = os.pipe()
    gc.disable()  # the cycle stays uncollected in the parent until the fork, as between two gc runs
    try:
        _Cyclic(write)
        pid = os.fork()
        if pid == 0:  # the child: collect, report, leave at once
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
    finally:
        gc.enable()
    gc.collect()  # the parent's own collection: its destructor runs here
    os.close(write)
    out = b""
    while chunk := os.read(read, 16):
        out += chunk
    os.close(read)
    return out


def test_a_forked_child_never_collects_the_parents_garbage():
    forks.install()  # as every loader does on first use (a producer thread, DataLoader workers)
    assert _fork_and_collect() == b"P"  # freed once, in the parent; never in the child


def test_the_hooks_are_installed_on_first_use_not_at_import():
    import subprocess
    import sys

    code = ("import loaders, loaders.images.loader, datapipe.device.handoff as h; from datapipe.device import forks; "
            "before = forks._state['installed']; list(h.Producer(iter(range(3)), depth=1)); "
            "print(before, forks._state['installed'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_the_parent_is_thawed_after_the_fork_and_a_users_freeze_is_kept():
    forks.install()
    assert gc.get_freeze_count() == 0
    _fork_and_collect()
    assert gc.get_freeze_count() == 0  # frozen only around the fork
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        # the process's own freeze is left as it was (a thaw would leave 0; a thread of an earlier test may free a
        # few frozen objects meanwhile: a CI run saw 2 fewer of 587,501)
        assert 0 <= frozen - gc.get_freeze_count() < 1000
    finally:
        gc.unfreeze()


def test_garbage_made_after_the_processs_own_freeze_is_never_collected_in_a_child():
    """A process that froze its collector itself (``gc.freeze()`` after the imports) still forks children that
    never free its later garbage; its freeze and its collector's state are as they were after the fork."""
    forks.install()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert _fork_and_collect() == b"P"
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        gc.unfreeze()


def test_objects_made_between_the_parents_freeze_and_the_fork_are_never_collected_in_the_child():
    """Other threads run while the fork's hooks do (here: a hook that runs after the freeze stands in for
    them): what they leave in cycles then is inherited unfrozen, and the child must not free it either."""
    import subprocess
    import sys

    code = f"""
import gc, os
PARENT = os.getpid()
class Cyclic:
    def __init__(self, fd):
        self.fd, self.me = fd, self
    def __del__(self):
        os.write(self.fd, b"C" if os.getpid() != PARENT else b"P")
read, write = os.pipe()
os.register_at_fork(before=lambda: Cyclic(write))  # registered first: runs after the freeze
from datapipe.device import forks
forks.install()
gc.disable()
pid = os.fork()
if pid == 0:
    gc.enable()
    gc.collect()
    os._exit(0)
os.waitpid(pid, 0)
gc.enable()
gc.collect()
os.close(write)
out = b""
while chunk := os.read(read, 16):
    out += chunk
print(out.decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.stdout.split() == ["P"], out.stderr
