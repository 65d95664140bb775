"""Bad data: the one exception type, and the one ``on_error`` policy that decides what happens to it.

The policy follows webdataset's handler model: a handler is a callable that takes the exception
and either raises (stop) or returns (skip the bad sample and go on). ``"raise"``, ``"skip"`` and
``"warn"`` name the built-in handlers. :class:`ErrorPolicy` applies a handler and counts, in one
place, what was skipped and the last few errors, so no loss goes unreported.
"""
from __future__ import annotations

import logging
from typing import Callable, Union

log = logging.getLogger("datapipe")

LAST_ERRORS = 10  # how many error messages stats() keeps


class DataError(Exception):
    """Bad data or unreadable storage. ``url`` and ``key`` name where (credentials redacted)."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None):
        self.url = url
        self.key = key
        where = []
        if url is not None:
            where.append(f"shard {url}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


def reraise(err: BaseException) -> None:
    """Handler ``"raise"``: stop with the error."""
    raise err


def skip(err: BaseException) -> None:
    """Handler ``"skip"``: drop the bad sample (counted by the policy)."""


def warn(err: BaseException) -> None:
    """Handler ``"warn"``: drop the bad sample and log a warning."""
    log.warning("skipped: %s", err)


HANDLERS: dict[str, Callable[[BaseException], None]] = {"raise": reraise, "skip": skip, "warn": warn}
OnError = Union[str, Callable[[BaseException], None]]


def check_on_error(on_error: OnError) -> OnError:
    """``on_error`` as given, after checking it is a handler name or a callable."""
    if callable(on_error) or on_error in HANDLERS:
        return on_error
    raise ValueError(f"on_error must be one of {tuple(HANDLERS)} or a callable taking the exception, "
                     f"got {on_error!r}")


class ErrorPolicy:
    """Applies an ``on_error`` handler and counts what it let through: ``errors``, ``skipped``, ``last_errors``."""

    def __init__(self, on_error: OnError = "raise"):
        self.on_error = check_on_error(on_error)
        self.handler = HANDLERS[on_error] if isinstance(on_error, str) else on_error
        self.errors = 0
        self.skipped = 0
        self.last_errors: list[str] = []

    @property
    def raises(self) -> bool:
        """True when every error stops the run (``"raise"``): readers need not resynchronise."""
        return self.handler is reraise

    def __call__(self, err: BaseException, *, lost: int = 1) -> None:
        """Hand ``err`` to the handler; if it returns, count ``lost`` samples as skipped."""
        self.handler(err)
        self.note(err, lost=lost)

    def note(self, err: BaseException, *, lost: int = 0) -> None:
        """Count an error that was already handled (``lost`` samples dropped because of it)."""
        self.errors += 1
        self.skipped += lost
        self.last_errors = (self.last_errors + [str(err)])[-LAST_ERRORS:]

    def stats(self) -> dict:
        return {"errors": self.errors, "skipped": self.skipped, "last_errors": list(self.last_errors)}
