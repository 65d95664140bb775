"""The peers benchmark's processes: every row in a fresh process, forked from a per-system parent that has
only imported that system's modules (so a row's figures exclude import time, reported apart, and no row
pays it again), with the peak PSS of the row's process tree sampled while it runs.

:class:`RowRunner` starts the parent (``python -c`` with :func:`serve`), sends it one row at a time and kills
a row's process tree when it passes its timeout. A row's output (stdout and stderr) goes to a log file, of
which the last line is quoted when the row fails.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable


# ---- PSS of a process tree -------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo += children(p)
    return out


def tree_pss_mb(pid: int) -> float | None:
    """PSS of ``pid`` and all its descendants, MB (``None`` where /proc has no smaps_rollup)."""
    total, found = 0, False
    for p in [pid] + descendants(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        found = True
                        break
        except OSError:
            continue
    return round(total / 1024, 1) if found else None


def kill_tree(pid: int) -> None:
    for p in descendants(pid) + [pid]:
        try:
            os.kill(p, 9)
        except OSError:
            pass


def _adopt_orphans() -> None:
    """Make this process its descendants' reaper (Linux): a process a row leaves behind whose parent exits (a
    daemon, a pool's helper) becomes this process's child instead of init's, so that :func:`descendants` still
    finds it and it is killed with the row. Best effort elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _kill_leftovers() -> None:
    """(The per-system parent, between rows) kill and reap whatever a finished row left running."""
    for p in descendants(os.getpid()):
        try:
            os.kill(p, 9)
        except OSError:
            pass
    while True:  # the row is reaped already: every child left is one of those, dying
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


# ---- the per-system parent (runs in its own process) -----------------------------------------------------------
def serve(modules: list[str], target: str) -> None:
    """Import ``modules``, say ``ready``, then per spec line on stdin fork a child that runs ``target(spec)``.

    Protocol (one JSON line each way): in ``{"spec": ..., "result": PATH, "log": PATH}``; out
    ``{"ready": import_s}``, then per row ``{"pid": child}`` and ``{"rc": status}``. The child writes its
    result (or ``{"error": ...}``) as JSON to ``PATH``.
    """
    import importlib

    _adopt_orphans()
    t0 = time.perf_counter()
    for m in modules:
        importlib.import_module(m)
    module, name = target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    out = os.fdopen(os.dup(1), "w")
    out.write(json.dumps({"ready": round(time.perf_counter() - t0, 3)}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the row's fresh process
            code = 1
            try:
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                try:
                    result, code = fn(job["spec"]), 0
                except BaseException as e:  # noqa: BLE001 - reported as the row's error
                    traceback.print_exc()
                    result = {"error": f"{type(e).__name__}: {e}"[:400]}
                with open(job["result"], "w") as f:
                    json.dump(result, f)
                del result
                import atexit
                import gc

                gc.collect()  # loaders' workers shut down as their iterators go
                atexit._run_exitfuncs()  # what the end of a fresh process runs (shared-memory clean-ups too)
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                for p in descendants(os.getpid()):  # nothing outlives its row
                    try:
                        os.kill(p, 9)
                    except OSError:
                        pass
                os._exit(code)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        _kill_leftovers()  # a daemon a row left (reparented here) would load the next rows
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


class RowRunner:
    """One system's parent process; :meth:`run` runs a row in a child forked from it.

    Args:
        modules: what the parent imports before any row (the system's modules).
        target: ``"module.function"`` that runs a row spec in the child and returns its result dict.
        start_timeout: seconds the imports may take.
    """

    def __init__(self, modules: list[str], *, target: str):
        self.dir = tempfile.mkdtemp(prefix="datapipe-peer-rows-")
        code = ("import json, sys; from datapipe.tools.bench.peer_process import serve; "
                "serve(json.loads(sys.argv[1]), sys.argv[2])")
        self.err = open(os.path.join(self.dir, "parent.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(modules), target], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1)
        self.count = 0
        self.import_s: float | None = None

    def wait(self, timeout: float = 300.0) -> float:
        """Seconds the parent's imports took, once they are done (``RuntimeError`` naming why if they fail)."""
        if self.import_s is None:
            ready = self._read(timeout)
            if ready is None or "ready" not in ready:
                raise RuntimeError(f"its row process did not start: "
                                   f"{self._tail(os.path.join(self.dir, 'parent.log'))}")
            self.import_s = ready["ready"]
        return self.import_s

    def _read(self, timeout: float) -> dict | None:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                return json.loads(line) if line else None

    @staticmethod
    def _tail(path: str) -> str:
        try:
            with open(path) as f:
                lines = [x for x in f.read().strip().splitlines() if x.strip()]
        except OSError:
            return "no output"
        return (lines[-1:] or ["no output"])[0][:300]

    def run(self, spec: dict, *, timeout: float, on_start: Callable[[], None] | None = None) -> dict:
        """Run ``spec`` in a fresh child: its result, ``process_s`` (wall time) and peak PSS of the tree, MB."""
        try:
            self.wait()
        except RuntimeError as e:
            return {"error": str(e)}
        self.count += 1
        result_path = os.path.join(self.dir, f"row-{self.count}.json")
        log = os.path.join(self.dir, f"row-{self.count}.log")
        load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None  # a busy host shows here
        t0 = time.perf_counter()
        self.proc.stdin.write(json.dumps({"spec": spec, "result": result_path, "log": log}) + "\n")
        self.proc.stdin.flush()
        started = self._read(30.0)
        if not started or "pid" not in started:
            return {"error": f"the row process did not fork: {self._tail(os.path.join(self.dir, 'parent.log'))}"}
        peak, done = [0.0], threading.Event()

        def sample():
            while not done.wait(0.1):
                v = tree_pss_mb(self.proc.pid)
                if v is not None:
                    peak[0] = max(peak[0], v)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            finished = self._read(max(0.1, timeout - (time.perf_counter() - t0)))
            if finished is None:
                kill_tree(started["pid"])  # what it left behind the parent kills once it has reaped the row
                self._read(30.0)
                return {"error": f"timed out after {timeout:.0f} s", "process_s": round(time.perf_counter() - t0, 2),
                        "loadavg_1m_before": load}
        finally:
            done.set()
            sampler.join()
        wall = round(time.perf_counter() - t0, 2)
        try:
            with open(result_path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"error": f"exit {finished.get('rc')}: {self._tail(log)}"}
        if "error" in result:
            return {**result, "process_s": wall, "log_tail": self._tail(log), "loadavg_1m_before": load}
        return {**result, "process_s": wall, "peak_pss_mb": peak[0] or None, "loadavg_1m_before": load}

    def close(self) -> None:
        if self.proc.poll() is None and self.import_s is None:
            kill_tree(self.proc.pid)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)
