"""``ReadOptions``: the rarer storage settings of a ``ShardStream``, in one frozen, validated group."""
from __future__ import annotations

from dataclasses import dataclass, field
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
class ReadOptions:
    """How a ``ShardStream`` reaches its shards (``ShardStream(..., read=ReadOptions(retries=8))``).

    Args:
        storage_options: passed to fsspec (credentials, endpoint, block size...).
        retries: transient failures (5xx, resets, truncated bodies) retried this many times in a row,
            resuming at the byte reached (no sample twice).
        timeout: seconds every remote wait may take (the HTTP / S3 client's connect and read timeouts,
            unless ``storage_options`` sets its own); None leaves the clients' own.
        backoff: the first retry's wait in seconds, doubling each time.
        allow_pipe: accept ``pipe:`` URLs (shell commands); refused otherwise.
        zero_copy: hand out values of local uncompressed shards as memoryviews into the mapped file.
    """

    storage_options: dict = field(default_factory=dict)
    retries: int = 5
    timeout: float | None = DEFAULT_TIMEOUT
    backoff: float = 0.2
    allow_pipe: bool = False
    zero_copy: bool = False

    def __post_init__(self):
        check_types("ReadOptions.", storage_options=(self.storage_options, (dict, type(None))),
                    retries=(self.retries, Integral), timeout=(self.timeout, (Real, type(None))),
                    backoff=(self.backoff, Real), allow_pipe=(self.allow_pipe, bool),
                    zero_copy=(self.zero_copy, bool))
        if self.storage_options is None:
            object.__setattr__(self, "storage_options", {})
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds (or None for the clients' own), "
                             f"got {self.timeout}")
        if self.retries < 0 or self.backoff < 0:
            raise ValueError("retries and backoff must be >= 0")

    def __hash__(self):  # storage_options is a dict
        return hash((tuple(sorted(map(repr, self.storage_options.items()))), self.retries, self.timeout,
                     self.backoff, self.allow_pipe, self.zero_copy))
