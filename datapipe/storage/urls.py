"""Shard URL specs: brace expansion, ``::`` joins, scheme checks and credential redaction."""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import braceexpand

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
_SECRET_QUERY_KEYS = re.compile(
    r"(?i)^(x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|access_token|"
    r"auth|password|passwd|secret|key|apikey|api_key|x-goog-signature|x-goog-credential|sv|se|sp|skoid)$"
)


def expand_urls(spec: str | list[str] | tuple[str, ...], *, allow_pipe: bool = False) -> list[str]:
    """Expand a shard spec into a list of URLs.

    ``spec`` is a string (brace ranges ``{000..127}``, lists ``{a,b}``, several specs joined by
    ``::``) or a list of such strings. ``pipe:`` URLs run shell commands and are refused unless
    ``allow_pipe=True``.
    """
    if isinstance(spec, (list, tuple)):
        parts = list(spec)
    elif isinstance(spec, str):
        parts = spec.split("::")
    else:
        raise ValueError(f"shard spec must be a string or a list of strings, got {type(spec).__name__}")
    urls: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise ValueError(f"shard spec entries must be strings, got {type(part).__name__}")
        part = part.strip()
        if not part:
            raise ValueError(f"empty shard spec in {redact_url(str(spec))!r}: give a path or URL, e.g. 'data/shard-{{000..009}}.tar'")
        _check_braces(part)
        for url in braceexpand.braceexpand(part):
            if url.startswith("pipe:") and not allow_pipe:
                raise ValueError(
                    f"pipe: URLs run shell commands and are refused: {redact_url(url)!r}; pass allow_pipe=True to allow them"
                )
            urls.append(url)
    if not urls:
        raise ValueError("shard spec expanded to no URLs")
    return urls


def _check_braces(part: str) -> None:
    depth = 0
    for ch in part:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                break
    if depth != 0:
        raise ValueError(f"malformed shard spec {redact_url(part)!r}: unbalanced braces")
    for body in re.findall(r"\{([^{}]*)\}", part):
        if ".." in body:
            lo, _, hi = body.partition("..")
            if not (lo.isdigit() and hi.isdigit()) and not (len(lo) == len(hi) == 1):
                raise ValueError(f"malformed brace range {{{body}}} in {redact_url(part)!r}: use e.g. {{000..127}}")
            if lo.isdigit() and hi.isdigit() and int(lo) > int(hi):
                raise ValueError(f"brace range {{{body}}} in {redact_url(part)!r} is empty: the start is above the end")


def url_scheme(url: str) -> str:
    """The URL's scheme (``file`` for plain paths)."""
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else "file"


def is_local(url: str) -> bool:
    return url_scheme(url) == "file"


def local_path(url: str) -> str:
    """The filesystem path of a local URL (plain path or ``file://``)."""
    return url[len("file://"):] if url.startswith("file://") else url


def redact_url(url: str) -> str:
    """Hide passwords in the netloc and secret-looking query values, for errors and logs."""
    if not isinstance(url, str) or "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = parts.query
    if query:
        items = []
        for item in query.split("&"):
            k, eq, v = item.partition("=")
            items.append(f"{k}=***" if eq and _SECRET_QUERY_KEYS.match(k) else item)
        query = "&".join(items)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
