"""Bad data: the one exception type, and the one ``on_error`` policy that decides what happens to it.

The policy follows webdataset's handler model: a handler is a callable that takes the exception
and either raises (stop) or returns (skip the bad sample and go on). ``"raise"``, ``"skip"`` and
``"warn"`` name the built-in handlers. :class:`ErrorPolicy` applies a handler and counts, in one
place, what was skipped and the last few errors, so no loss goes unreported.
"""
from __future__ import annotations

import ast
import functools
import logging
import re
from typing import Callable, Union

from datapipe.storage.locations import redact_text

log = logging.getLogger("datapipe")

LAST_ERRORS = 10  # how many error messages stats() keeps


class DataError(Exception):
    """Bad data or unreadable storage. ``url`` and ``key`` name where; ``what`` says what ``url`` is
    (``"shard"``, ``"manifest"``, ``"folder"``). Credentials in URLs, in ``url`` or quoted in ``message``
    (e.g. from a library's exception), are redacted."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None, what: str = "shard"):
        message = redact_text(message)
        url = redact_text(url) if url is not None else None
        if url is None and key is None and message.startswith("Caught DataError "):
            what, url, key = _worker_where(message)  # torch's re-raise of a worker's DataError: its message only
            self.url, self.key, self.what = url, key, what
            self.hinted = SKIP_HINT in message
            super().__init__(message)
            return
        self.url = url
        self.key = key
        self.what = what
        where = []
        if url is not None:
            where.append(f"{what} {url}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


_QUOTED = r"""('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""
_KEY = re.compile(r"(, | \()key " + _QUOTED + r"\)\Z")
_URL = re.compile(r" \((shard|manifest|folder|glob|target) (.*)\)\Z", re.S)


def _worker_where(message: str) -> tuple[str, str | None, str | None]:
    """``(what, url, key)`` from the last ``DataError: ... (shard URL, key 'K')`` line of torch's message for a
    DataLoader worker's exception (``ExceptionWrapper`` rebuilds it from that text alone); None where it names
    none."""
    at = message.rfind("DataError: ")
    text = message[at + len("DataError: "):].rstrip() if at >= 0 else ""
    for hint in (CHECK_HINT, SKIP_HINT):
        if text.endswith(hint):
            text = text[:-len(hint)]
    key = None
    m = _KEY.search(text)
    if m is not None:
        try:
            key = ast.literal_eval(m.group(2))
        except (ValueError, SyntaxError):
            return "shard", None, None
        if m.group(1) == " (":  # a key, no URL
            return "shard", None, key
        text = text[:m.start()] + ")"
    starts = [m.start() for m in re.finditer(r" \((?:shard|manifest|folder|glob|target) ", text)]
    m = _URL.match(text, starts[-1]) if starts else None
    return (m.group(1), m.group(2), key) if m is not None else ("shard", None, key)


SKIP_HINT = ('; to skip such samples instead, pass on_error="skip" (counted in stats()) or "warn" (also logs '
             'each)')
CHECK_HINT = "; `datapipe shard --check-images decode` finds undecodable images when the shards are written"


def with_hint(err: BaseException) -> BaseException:
    """``err``, its message ending in what to do about it when it is a bad sample's ``DataError`` (it names a key):
    the ``on_error`` modes that skip it, and for an image the shard job's check. Once per error."""
    if not isinstance(err, DataError) or err.key is None or getattr(err, "hinted", False) or len(err.args) != 1:
        return err
    message = str(err.args[0])
    hint = SKIP_HINT + (CHECK_HINT if "image" in message.lower() else "")
    err.args = (message + hint,)
    err.hinted = True
    return err


def reraise(err: BaseException) -> None:
    """Handler ``"raise"``: stop with the error (a bad sample's says how to skip such samples instead)."""
    raise with_hint(err)


def skip(err: BaseException) -> None:
    """Handler ``"skip"``: drop the bad sample (counted by the policy)."""


def warn(err: BaseException, *, log: logging.Logger = log) -> None:
    """Handler ``"warn"``: drop the bad sample and log a warning (on ``log``, ``datapipe`` by default)."""
    log.warning("skipped: %s", redact_text(err))


HANDLERS: dict[str, Callable[[BaseException], None]] = {"raise": reraise, "skip": skip, "warn": warn}
OnError = Union[str, Callable[[BaseException], None]]


def check_on_error(on_error: OnError) -> OnError:
    """``on_error`` as given, after checking it is a handler name or a callable."""
    if callable(on_error) or on_error in HANDLERS:
        return on_error
    raise ValueError(f"on_error must be one of {tuple(HANDLERS)} or a callable taking the exception, "
                     f"got {on_error!r}")


def remember(last_errors: list[str], err: BaseException) -> list[str]:
    """``last_errors`` with ``err``'s message added, keeping the last ``LAST_ERRORS``."""
    return (last_errors + [redact_text(err)])[-LAST_ERRORS:]


class ErrorPolicy:
    """Applies an ``on_error`` handler and counts what it let through: ``errors``, ``skipped``, ``last_errors``.

    ``log``: the logger the ``"warn"`` handler writes to (the caller's own, so its name says who skipped).
    """

    def __init__(self, on_error: OnError = "raise", *, log: logging.Logger | None = None):
        self.on_error = check_on_error(on_error)
        self.handler = HANDLERS[on_error] if isinstance(on_error, str) else on_error
        if self.handler is warn and log is not None:
            self.handler = functools.partial(warn, log=log)
        self.errors = 0
        self.skipped = 0
        self.last_errors: list[str] = []
        self.stopped: BaseException | None = None  # what the handler raised last: stop, never handle it again

    @property
    def raises(self) -> bool:
        """True when every error stops the run (``"raise"``): readers need not resynchronise."""
        return self.handler is reraise

    def __call__(self, err: BaseException, *, lost: int = 1, counted: bool = True) -> None:
        """Hand ``err`` to the handler; if it returns, count ``lost`` samples as skipped (and the error, if
        ``counted``: not when another DataLoader worker counted the same fault)."""
        try:
            self.handler(err)
        except BaseException as stop:
            self.stopped = stop
            raise
        if counted:
            self.note(err, lost=lost)
        else:
            self.skipped += lost

    def __getstate__(self):
        return {**self.__dict__, "stopped": None}  # a live exception (and its traceback) stays in its process

    def reset(self) -> None:
        """Count from zero (a DataLoader worker's copy of a stream counts only its own errors)."""
        self.errors = self.skipped = 0
        self.last_errors = []

    def note(self, err: BaseException, *, lost: int = 0) -> None:
        """Count an error that was already handled (``lost`` samples dropped because of it)."""
        self.errors += 1
        self.skipped += lost
        self.last_errors = remember(self.last_errors, err)

    def stats(self) -> dict:
        """``{"errors", "skipped", "last_errors"}`` (a copy)."""
        return {"errors": self.errors, "skipped": self.skipped, "last_errors": list(self.last_errors)}
