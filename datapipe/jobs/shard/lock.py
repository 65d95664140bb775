"""The lock that makes one ``datapipe shard`` job own its output folder.

``OUT/.datapipe-lock`` holds who writes the folder (pid, host, start time). On a local disk the
lock is an exclusive ``flock`` on that file: the kernel releases it when the process dies, however
it dies, so a killed job's lock is taken over safely by the next one (its file is only a note).
On other storage (fsspec URLs) the file itself is the lock; it is stale when its holder no longer
runs (same host: the pid is gone) or when its heartbeat, refreshed while the job runs, is older
than :data:`STALE_S` (another host).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from datapipe.jobs.shard.journal import join_url
from datapipe.storage.files import filesystem
from datapipe.storage.urls import redact_text, redact_url

log = logging.getLogger("datapipe.jobs.shard.lock")

LOCK_NAME = ".datapipe-lock"
STALE_S = 120.0  # a remote lock whose heartbeat is older than this is a killed job's
HEARTBEAT_S = 20.0


class LockedError(RuntimeError):
    """OUT is being written by another job."""


def _describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {when}"


def _me() -> dict:
    now = time.time()
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now, "heartbeat": now}


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """An exclusive lock on the output folder ``out``; a context manager. Raises :class:`LockedError`
    ("OUT is being written by another job (pid N on HOST since T)") when another job holds it."""

    def __init__(self, out: str, *, storage_options: dict | None = None):
        self.out = out
        self.url = join_url(out, LOCK_NAME)
        self.options = dict(storage_options or {})
        self._fd: int | None = None
        self._stop: threading.Event | None = None
        self._token: dict | None = None
        self._created = False

    # ---- local: flock ----------------------------------------------------------------------------
    def _acquire_local(self, path: str) -> None:
        import fcntl

        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_fd(fd)
                os.close(fd)
                raise LockedError(f"{self.out} is being written by another job ({_describe(holder)}); "
                                  "wait for it to finish, or choose another OUT") from None
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file as we opened it: lock the file that is there now
        previous = _read_fd(fd)
        if previous:
            log.info("taking over the lock of a job that ended without releasing it (%s)", _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        self._fd = fd

    # ---- remote: a lock file with a heartbeat -----------------------------------------------------------
    def _acquire_remote(self, fs, path: str) -> None:
        me = _me()
        try:
            holder = json.loads(fs.cat_file(path))
        except FileNotFoundError:
            holder = None
        except ValueError:
            holder = {}
        if holder is not None and not _stale(holder):
            raise LockedError(f"{self.out} is being written by another job ({_describe(holder)}); "
                              "wait for it to finish, or choose another OUT")
        if holder:
            log.info("taking over a stale lock (%s)", _describe(holder))
        me["token"] = os.urandom(8).hex()
        fs.pipe_file(path, json.dumps(me).encode())
        time.sleep(0.05)  # a job that wrote at the same moment: the last writer wins, the other one sees it
        if json.loads(fs.cat_file(path)).get("token") != me["token"]:
            raise LockedError(f"{self.out} is being written by another job (it took the lock at the same moment)")
        self._token = me
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, args=(fs, path), name="datapipe-lock-heartbeat", daemon=True).start()

    def _heartbeat(self, fs, path: str) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._token["heartbeat"] = time.time()
                fs.pipe_file(path, json.dumps(self._token).encode())
            except Exception as e:  # the job goes on; a failed heartbeat only weakens the lock
                log.warning("could not refresh the lock %s: %s", redact_url(self.url), redact_text(e))

    def __enter__(self) -> OutputLock:
        fs, path = filesystem(self.url, self.options)
        out_path = filesystem(self.out, self.options)[1]
        self._created = not fs.exists(out_path)
        fs.makedirs(out_path, exist_ok=True)
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(fs, LocalFileSystem):
            self._acquire_local(path)
        else:
            self._acquire_remote(fs, path)
        return self

    def fileno(self) -> int | None:
        """The lock's file descriptor (local disks), which forked workers close."""
        return self._fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fs, path = filesystem(self.url, self.options)
            try:
                os.unlink(path)  # still ours: the flock is held until the close below
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
            if self._created:  # a job that failed before writing anything leaves no empty OUT behind
                try:
                    os.rmdir(filesystem(self.out, self.options)[1])
                except OSError:
                    pass
        elif self._stop is not None:
            self._stop.set()
            fs, path = filesystem(self.url, self.options)
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass


def _read_fd(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


def _stale(holder: dict) -> bool:
    """Whether a remote lock's holder is gone: same host and its pid is not running, or no heartbeat lately."""
    if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
        return True
    beat = holder.get("heartbeat")
    return not isinstance(beat, (int, float)) or time.time() - beat > STALE_S
