"""``StorageOptions``: the rarer storage settings of a ``ShardStream``, in one frozen, validated group."""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from datapipe.storage.files import DEFAULT_TIMEOUT


def check_types(owner: str, **args: tuple[Any, type | tuple[type, ...]]) -> None:
    """``TypeError`` naming the first argument whose value is not of its type (bools are not numbers)."""
    for name, (value, types) in args.items():
        types = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join({type(None): "None", Integral: "int", Real: "a number"}.get(t, t.__name__)
                                 for t in types)
            raise TypeError(f"{owner}{name} must be {wanted}, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class StorageOptions:
    """How a ``ShardStream`` reads its shards (``ShardStream(..., storage=StorageOptions(retries=8))``).

    Args:
        retries: transient failures (5xx, resets, truncated bodies, stalls) retried, resuming at the byte
            reached (no sample twice). Failures cost the time they took: a shard gives up after
            ``retries + 1`` failures with no byte between them, or once its failures have lost
            ``(retries + 1) x timeout`` plus the time its bytes took (docs/guarantees.md, the bound on
            remote-read faults).
        timeout: seconds every remote wait may take (the HTTP / S3 client's connect and read timeouts,
            unless ``storage_options`` sets its own); None leaves the clients' own.
        backoff: the first retry's wait in seconds, doubling each time.
        allow_pipe: accept ``pipe:`` URLs (shell commands); refused otherwise.
        zero_copy: hand out values of local uncompressed shards as memoryviews into the mapped file.
        keep_freed_memory: when reading starts, raise glibc malloc's trim and mmap thresholds in this process,
            so that freed samples' memory is reused instead of faulted in afresh (1.5-3x at 100 KB samples
            where the heap's top was given back, no different where it stays in use; the process keeps up to
            1 GiB freed; :mod:`datapipe.read.heap`).
        read_threads: pool threads that read a local shard's values ahead, ~8 MB a thread at a time, with one
            ``preadv`` each (:mod:`datapipe.read.spans`), so that the kernel's copies leave the consuming thread;
            None (the default): one per 4 usable cores, at least 2 and at most 4 (0 on one core, and 0 in a
            DataLoader worker, where the workers are the parallelism); 0: one ``pread`` per value.
    """

    retries: int = 5
    timeout: float | None = DEFAULT_TIMEOUT
    backoff: float = 0.2
    allow_pipe: bool = False
    zero_copy: bool = False
    keep_freed_memory: bool = True
    read_threads: int | None = None

    def __post_init__(self):
        check_types("StorageOptions.", retries=(self.retries, Integral), timeout=(self.timeout, (Real, type(None))),
                    backoff=(self.backoff, Real), allow_pipe=(self.allow_pipe, bool),
                    zero_copy=(self.zero_copy, bool), keep_freed_memory=(self.keep_freed_memory, bool),
                    read_threads=(self.read_threads, (Integral, type(None))))
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds (or None for the clients' own), "
                             f"got {self.timeout}")
        if self.retries < 0 or self.backoff < 0:
            raise ValueError("retries and backoff must be >= 0")
        if self.read_threads is not None and not 0 <= self.read_threads <= 64:
            raise ValueError(f"read_threads must be 0 to 64 (or None: chosen from the cores), got {self.read_threads}")
