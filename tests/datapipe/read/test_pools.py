"""process_pool: one pool a purpose per process, grown when more threads are asked for, new in a forked child."""
import os

from datapipe.read.pools import current, process_pool


def test_one_pool_a_name_grown_on_demand():
    a = process_pool("test-pools-a", 2)
    assert process_pool("test-pools-a", 1) is a and current("test-pools-a") is a
    assert process_pool("test-pools-b", 1) is not a
    bigger = process_pool("test-pools-a", 3)
    assert bigger is not a and bigger._max_workers == 3 and current("test-pools-a") is bigger
    assert bigger.submit(lambda: 7).result() == 7
    assert current("test-pools-none") is None


def test_a_forked_child_makes_its_own():
    parent = process_pool("test-pools-fork", 1)
    parent.submit(lambda: None).result()  # its thread exists in the parent only
    pid = os.fork()
    if pid == 0:
        ok = current("test-pools-fork") is None and process_pool("test-pools-fork", 1).submit(lambda: 1).result() == 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and current("test-pools-fork") is parent
