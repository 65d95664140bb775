"""What a storage failure is: permanent or worth retrying, a credential problem, a timeout of which kind, and
its message with every credential string (URL passwords, secret query values, storage-option keys) scrubbed."""
from __future__ import annotations

import traceback
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from datapipe.storage.locations import _SECRET_QUERY_KEYS

_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, NotImplementedError, ValueError)

# credential problems (botocore, google-auth, azure): retrying cannot fix them
_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                      "NoAuthTokenError", "UnauthorizedSSOTokenError", "TokenRetrievalError",
                      "DefaultCredentialsError", "RefreshError", "ClientAuthenticationError")
_CONNECTION_ERRORS = ("ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError", "ServerTimeoutError")


def _chain(e: BaseException, limit: int = 10):
    """``e`` and its causes, outermost first."""
    seen = 0
    while e is not None and seen < limit:
        yield e
        e, seen = e.__cause__ or e.__context__, seen + 1


def _is_named(e: BaseException, names: tuple[str, ...]) -> bool:
    return any(cls.__name__ in names for cls in type(e).__mro__)


def is_credential_error(e: BaseException) -> bool:
    """Missing or invalid credentials anywhere in ``e``'s causes (botocore ``NoCredentialsError`` ...)."""
    return any(_is_named(c, _CREDENTIAL_ERRORS) for c in _chain(e))


def is_permanent(e: BaseException) -> bool:
    """A failure retrying cannot fix (missing file, no permission, missing credentials, bad argument).

    fsspec's HTTP filesystem reports any failed metadata request as FileNotFoundError, a 503 or a
    reset included: such an error caused by a server error (5xx, 429) or a connection problem is
    transient.
    """
    if is_credential_error(e):
        return True
    if not isinstance(e, _PERMANENT):
        return False
    for cause in _chain(e.__cause__ or e.__context__):
        status = getattr(cause, "status", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return False
        if isinstance(cause, (ConnectionError, TimeoutError)) or type(cause).__name__ in _CONNECTION_ERRORS:
            return False
    return True


def is_missing(e: BaseException) -> bool:
    """``e`` says the file does not exist: a permanent ``FileNotFoundError`` that, over HTTP, was a 404 or 410
    (fsspec's HTTP reports a 403 as FileNotFoundError too)."""
    if not isinstance(e, FileNotFoundError) or not is_permanent(e):
        return False
    statuses = [c.status for c in _chain(e.__cause__ or e.__context__) if isinstance(getattr(c, "status", None), int)]
    return not statuses or statuses[0] in (404, 410)


_SECRET_OPTION = ("key", "secret", "token", "password", "passwd", "auth", "credential", "signature", "session")


def secrets_of(url: str, storage_options: dict | None = None) -> list[str]:
    """Credential strings of a URL (password, secret query values) and of storage options (keys, tokens)."""
    found: list[str] = []
    try:
        parts = urlsplit(url) if "://" in url else None
    except ValueError:
        parts = None
    if parts is not None:
        if parts.password:
            found.append(parts.password)
        for k, v in parse_qsl(parts.query, keep_blank_values=False):
            if _SECRET_QUERY_KEYS.match(k):
                found.append(v)

    def walk(obj, name=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, str(k).lower())
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, name)
        elif isinstance(obj, str) and any(word in name for word in _SECRET_OPTION):
            found.append(obj)
        elif hasattr(obj, "password") and isinstance(getattr(obj, "password", None), str):  # aiohttp.BasicAuth
            found.append(obj.password)

    walk(storage_options or {})
    out = set()
    for secret in found:
        if secret:
            out.update({secret, quote(secret, safe=""), unquote(secret)})
    return sorted((s for s in out if s), key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with every credential string replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class StorageError(Exception):
    """A storage failure whose message had credentials in it: the same text, scrubbed."""


_CONNECT_TIMEOUTS = ("ConnectionTimeoutError", "ConnectTimeoutError")
_READ_TIMEOUTS = ("SocketTimeoutError", "ReadTimeoutError", "ReadTimeout")


def timeout_kind(e: BaseException) -> str | None:
    """What timed out in ``e`` (or its causes): ``"read"`` (the server went quiet), ``"connect"``, ``"other"``
    (a timeout of unknown kind), or None when nothing did."""
    kind = None
    for cause in _chain(e):
        if _is_named(cause, _READ_TIMEOUTS):
            return "read"
        if _is_named(cause, _CONNECT_TIMEOUTS):
            return "connect"
        if isinstance(cause, TimeoutError) or _is_named(cause, ("ServerTimeoutError",)):
            kind = "other"
    return kind


def describe(e: BaseException, secrets: list[str]) -> tuple[str, BaseException]:
    """``"Type: message"`` of ``e`` without credentials, and the exception to chain from.

    When credentials appear anywhere in ``e``'s traceback text, a scrubbed ``StorageError``
    replaces it as the cause, so that printing the error chain cannot show them.
    """
    text = scrub(f"{type(e).__name__}: {e}", secrets)
    for cause in _chain(e):
        kind = timeout_kind(cause)
        if kind or isinstance(cause, ConnectionError) or _is_named(cause, _CONNECTION_ERRORS):
            detail = next((c for c in _chain(cause) if str(c)), cause) if kind else cause  # the one that says why
            words = {"read": "no answer within the timeout", "other": "timed out"}.get(kind, "cannot connect")
            text = scrub(f"{words}: {type(detail).__name__}: {detail}", secrets)  # not "file not found"
            break
        if _is_named(cause, _CREDENTIAL_ERRORS):
            text = scrub(f"{type(cause).__name__}: {cause} (pass credentials in storage_options, e.g. "
                         "{'key': ..., 'secret': ...} for S3, {'token': ...} for GCS)", secrets)
            break
    if secrets:
        full = "".join(traceback.format_exception(e))
        if scrub(full, secrets) != full:
            return text, StorageError(scrub(full, secrets))
    return text, e
