"""(Main process) a worker batch's values read from their shard files, where the worker named the file's bytes
instead of copying them (:mod:`datapipe.read.origins`).

A worker of a pass that names files (:func:`names_files`: a machine of :data:`loaders.dataloader.copyout.READ_MIN_CORES`
cores or more, where the copy-out reads with ``preadv`` in threads) sends a raw value it read from a local shard,
unchanged, as ``(file, offset, length)``; :class:`FileReads` opens each file once (and checks it is the one the
worker read: the same device, inode, size and modification time, every batch), and reads the values into the
consumer's new ``bytes`` with ``preadv`` in the copy-out's threads: one copy from the page cache, where the
worker's ``bytes`` into its segment and the segment into the consumer's ``bytes`` made two. A file that changed
since the worker read it, or that no longer holds a value whole, is an error naming it: the batch is not handed
out.

**Off by default** (:data:`ENABLED`): not yet measured on a 16-core host, where it is meant to lift the workers'
raw rows (#43; ``.devrun/call_n1.sh`` is that A/B), and it changes two things a user may rely on: a local shard
replaced atomically while a pass reads it (a rewrite into the folder) fails the pass with :class:`FileChanged`,
where a worker's open descriptor read the old shard whole, and a FUSE or network mount whose inode numbers are not
stable would fail the same way. :class:`FileChanged` is a :class:`~datapipe.errors.DataError` naming the file. The
tests turn it on.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os

from datapipe.errors import DataError
from datapipe.read import origins, rawbytes
from datapipe.read.spans import start_spans
import loaders.dataloader.copyout as copyout

__all__ = ["FileChanged", "FileReads", "names_files", "noting_in_workers", "read_one", "reading_out"]


class FileChanged(DataError):
    """A shard file a worker named changed (or shrank) before the main process read its values (``url``: the file)."""

    def __init__(self, message: str, path: str):
        super().__init__(message, url=path)


ENABLED = False  # see the module's notes: on once the host measures a gain and the two changes are settled


def names_files() -> bool:
    """Whether this process's workers name shard files instead of copying their values (see the module)."""
    return ENABLED and copyout.read_threads() >= 2 and origins.available()


@contextlib.contextmanager
def noting_in_workers(on: bool):
    """Workers forked inside note their values' origins (:func:`datapipe.read.origins.enable`: on inside, so that
    they inherit it, and off again in this process after)."""
    if not on:
        yield
        return
    origins.enable()
    try:
        yield
    finally:
        origins.enable(False)


MAX_OPEN = 64  # shard files kept open at most (the least recently read closed first)


class FileReads:
    """(Main process) the shard files workers named, at most :data:`MAX_OPEN` kept open; :meth:`start` starts
    reading values out of them."""

    def __init__(self):
        self.fds: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.reads = 0  # values read from files so far

    def fd(self, file: tuple) -> int:
        """An open descriptor of ``file`` (``(path, st_dev, st_ino, st_size, st_mtime_ns)``), checked unchanged."""
        fd = self.fds.get(file)
        if fd is None:
            try:
                fd = os.open(file[0], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as e:
                raise FileChanged(f"loaders.DataLoader: shard file {file[0]} a worker read can no longer be opened "
                                  f"({e})", file[0]) from e
            self.fds[file] = fd
            while len(self.fds) > MAX_OPEN:  # a read under way has a duplicate of its own (start_spans)
                os.close(self.fds.popitem(last=False)[1])
        else:
            self.fds.move_to_end(file)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != file[1:]:
            self._drop(file)
            raise FileChanged(f"loaders.DataLoader: shard file {file[0]} changed while it was being read (its size, "
                              "modification time or inode is not the one a worker read); its values are not handed "
                              "out", file[0])
        return fd

    def start(self, wanted: list[tuple[tuple, int, int]], threads: int):
        """Start reading each ``(file, offset, length)`` of ``wanted`` into a new ``bytes``: ``(values, readings)``,
        the values in order, not to be read before :func:`finish` says they are whole."""
        by_file: dict[tuple, list[int]] = {}
        for i, (file, _, _) in enumerate(wanted):
            by_file.setdefault(file, []).append(i)
        values: list = [None] * len(wanted)
        readings = []
        for file, at in by_file.items():
            fd = self.fd(file)
            reading = start_spans(fd, [wanted[i][1:] for i in at], threads=max(1, threads))
            if reading is None:  # no preadv here (or shutting down): one pread a value, in this thread
                for i in at:
                    values[i] = _pread_whole(fd, file, *wanted[i][1:])
                continue
            for i, value in zip(at, reading.values):
                values[i] = value
            readings.append((file, reading, [wanted[i][1:] for i in at]))
        self.reads += len(wanted)
        return values, readings

    def finish(self, readings) -> None:
        """Wait for ``readings`` (from :meth:`start`); raise :class:`FileChanged` where a file no longer held a
        value whole. A reading whose ``preadv`` failed (a sandbox that refuses it, an error) is read again, a
        ``pread`` a value into the same ``bytes`` (not handed out yet): only a file that changed is an error."""
        failed = [(file, reading, spans) for file, reading, spans in readings if reading.result() is None]
        for file, reading, spans in failed:  # every reading is done: no thread writes into a value any more
            fd = self.fd(file)
            for value, (offset, n) in zip(reading.values, spans):
                ctypes.memmove(rawbytes.data_address(value), _pread_whole(fd, file, offset, n), n)

    def _drop(self, file: tuple) -> None:
        fd = self.fds.pop(file, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for file in list(self.fds):
            self._drop(file)

    def __del__(self):  # a pass's or loader's copies dropped without clear() (persistent workers, a loader let go)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - an interpreter shutting down
            pass


def _pread_whole(fd: int, file: tuple, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise FileChanged(f"loaders.DataLoader: shard file {file[0]} ended before a value a worker read from it "
                          "(it shrank or was replaced)", file[0])
    return data


class _Both:
    """The copies out of a segment and the reads out of files of one batch: ``wait()`` waits for all of them
    (also where one raises) and raises the first error."""

    def __init__(self, copying, files: FileReads, readings: list):
        self.copying, self.files, self.readings = copying, files, readings

    def wait(self) -> None:
        try:
            self.copying.wait()
        finally:
            readings, self.readings = self.readings, []
            self.files.finish(readings)


def reading_out(kinds: str, spans, sources, files: FileReads, view, fd, fd_offset: int):
    """A batch's raw leaves, ``b`` ones copied out of the segment (``view``, its file ``fd``: as
    :func:`loaders.dataloader.copyout.copying_out`) and ``s`` ones read from the files ``sources`` names (one
    file a leaf, in order), and what is still under way (``wait()`` before any leaf is read)."""
    in_segment, wanted = [], []
    at = 0
    for i, kind in enumerate(kinds):
        offset, n = spans[2 * i], spans[2 * i + 1]
        if kind == "s":
            wanted.append((sources[at], offset, n))
            at += 1
        else:
            in_segment.extend((offset, n))
    values, readings = files.start(wanted, copyout.read_threads())
    copied, copying = (copyout.copying_out(view, in_segment, fd=fd, fd_offset=fd_offset) if in_segment
                       else ([], copyout.Copying()))
    out = []
    read, segment = iter(values), iter(copied)
    for kind in kinds:
        out.append(next(read) if kind == "s" else next(segment))
    return out, _Both(copying, files, readings)


def read_one(files: FileReads, file: tuple, offset: int, n: int) -> bytes:
    """One leaf a worker named in ``file``, read in this thread."""
    files.reads += 1
    return _pread_whole(files.fd(file), file, offset, n)
