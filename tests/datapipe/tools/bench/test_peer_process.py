"""datapipe.tools.bench.peer_process: every row in a fresh process forked from one that only imported."""
import os
import time

from datapipe.tools.bench.peer_process import RowRunner, tree_pss_mb

TARGET = "tests.datapipe.tools.bench.test_peer_process.row"
LOADED_BY_PARENT = "json"


def row(spec: dict) -> dict:
    """The row function the runner's children call (importable by name)."""
    import sys

    if spec.get("fail"):
        raise KeyError("no such shard")
    if spec.get("daemon"):  # a grandchild that outlives its parent, as a worker pool's helper may
        r, w = os.pipe()
        if os.fork() == 0:
            pid = os.fork()
            if pid == 0:
                time.sleep(120)
                os._exit(0)
            os.write(w, str(pid).encode())
            os._exit(0)
        os.wait()
        return {"daemons": [int(os.read(r, 64))]}
    if spec.get("sleep"):
        time.sleep(spec["sleep"])
    print("a library that prints on stdout")  # must not garble the protocol
    return {"pid": os.getpid(), "ppid": os.getppid(), "imported": LOADED_BY_PARENT in sys.modules,
            "marker": spec.get("marker")}


def test_what_a_row_left_running_goes_with_it():
    runner = RowRunner([], target=TARGET)
    try:
        left = runner.run({"daemon": True}, timeout=60)
        runner.run({"marker": 5}, timeout=60)  # the daemon is killed once its row is over
    finally:
        runner.close()
    assert left["daemons"] and "loadavg_1m_before" in left
    assert all(not os.path.exists(f"/proc/{p}") for p in left["daemons"])  # killed and reaped


def test_each_row_is_a_fresh_child_of_the_process_that_imported():
    runner = RowRunner(["json"], target=TARGET)
    try:
        assert runner.wait() >= 0
        a = runner.run({"marker": 1}, timeout=60)
        b = runner.run({"marker": 2}, timeout=60)
    finally:
        runner.close()
    assert a["marker"] == 1 and b["marker"] == 2
    assert a["pid"] != b["pid"] and a["ppid"] == b["ppid"] == runner.proc.pid  # two processes, one parent
    assert a["imported"] and a["process_s"] > 0
    assert runner.proc.poll() is not None  # closed: the parent is gone too


def test_a_failing_row_is_an_error_naming_why_and_the_next_row_runs():
    runner = RowRunner([], target=TARGET)
    try:
        bad = runner.run({"fail": True}, timeout=60)
        good = runner.run({"marker": 3}, timeout=60)
    finally:
        runner.close()
    assert bad["error"] == "KeyError: 'no such shard'" and "KeyError" in bad["log_tail"]
    assert good["marker"] == 3


def test_a_row_past_its_timeout_is_killed_and_reported():
    runner = RowRunner([], target=TARGET)
    try:
        slow = runner.run({"sleep": 120}, timeout=2)
        after = runner.run({"marker": 4}, timeout=60)
    finally:
        runner.close()
    assert slow["error"] == "timed out after 2 s"
    assert after["marker"] == 4


def test_a_parent_that_cannot_import_says_so():
    runner = RowRunner(["no_such_module_here"], target=TARGET)
    try:
        out = runner.run({}, timeout=60)
    finally:
        runner.close()
    assert "did not start" in out["error"] and "no_such_module_here" in out["error"]


def test_pss_of_this_process_is_measured():
    assert tree_pss_mb(os.getpid()) > 0
