"""What a URL names: its scheme, its local path, and its form with credentials hidden (for errors and logs)."""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
_SECRET_QUERY_KEYS = re.compile(
    r"(?i)^(x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|access_token|"
    r"auth|password|passwd|secret|key|apikey|api_key|x-goog-signature|x-goog-credential|sv|se|sp|skoid)$"
)


# a URL inside free text: scheme://, then up to whitespace, a quote, an angle bracket or a closing ) ]
_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s'\"<>)\]]+")


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


def redact_text(text: object) -> str:
    """``str(text)`` (any text, or an exception) with every URL in it redacted as :func:`redact_url` does:
    for log lines and error messages that quote foreign text."""
    text = str(text)
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)) if "@" in m.group(0) or "?" in m.group(0)
                            else m.group(0), text)
