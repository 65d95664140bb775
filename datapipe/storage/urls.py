"""Shard URL specs: brace expansion, globs, ``::`` joins, folders that stand for their dataset, and (re-exported from
``datapipe.storage.locations``) scheme checks and credential redaction."""
from __future__ import annotations

import os
import posixpath
import re
from typing import Sequence

import braceexpand

from datapipe.errors import DataError
from datapipe.storage.locations import is_local, local_path, redact_text, redact_url, url_scheme

__all__ = ["expand_urls", "folder_advice", "is_local", "local_path", "redact_text", "redact_url", "url_scheme",
           "SHARD_SUFFIXES"]


SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_GLOB = re.compile(r"[*?\[]")
_HTTP_GLOB = re.compile(r"[*\[]")


def expand_urls(spec: str | list[str] | tuple[str, ...], *, allow_pipe: bool = False,
                storage_options: dict | None = None) -> list[str]:
    """Expand a shard spec into a list of URLs.

    ``spec`` is a string (brace ranges ``{000..127}``, lists ``{a,b}``, globs ``*`` ``?`` ``[...]``, several
    specs joined by ``::``) or a list of such strings. A glob expands through fsspec to the files it matches,
    in name order (in an ``http(s)`` URL ``?`` starts the query, not a glob); one that matches nothing is a
    ``DataError``. A folder (local, or any fsspec URL, with or without its trailing ``/``) stands for its
    dataset: the shards its ``manifest.json`` lists, else its ``.tar`` files in name order. ``pipe:`` URLs
    run shell commands and are refused unless ``allow_pipe=True``. ``storage_options`` are passed to
    fsspec where a remote folder or glob is listed.
    """
    return list(shard_urls(spec, allow_pipe=allow_pipe, storage_options=storage_options))


def shard_urls(spec: str | list[str] | tuple[str, ...], *, allow_pipe: bool = False,
               storage_options: dict | None = None) -> Sequence[str]:
    """:func:`expand_urls`'s URLs, where a lone folder with a manifest stays a compact
    :class:`~datapipe.storage.shard_list.ShardList` (carrying the manifest's counts) and a lone numeric brace
    range over shard names a lazy :class:`~datapipe.storage.shard_list.NumberedUrls`, instead of a list."""
    if isinstance(spec, (list, tuple)):
        parts = list(spec)
    elif isinstance(spec, (str, os.PathLike)):
        parts = os.fspath(spec).split("::")
    else:
        raise ValueError(f"shard spec must be a string or a list of strings, got {type(spec).__name__}")
    urls: list[str] = []
    for part in parts:
        if isinstance(part, os.PathLike):
            part = os.fspath(part)
        if not isinstance(part, str):
            raise ValueError(f"shard spec entries must be strings, got {type(part).__name__}")
        part = part.strip()
        if not part:
            raise ValueError(f"empty shard spec in {redact_url(str(spec))!r}: give a path or URL, e.g. 'data/shard-{{000..009}}.tar'")
        _check_braces(part)
        expanded = _brace_expand(part)
        _check_padding(part, expanded)
        if len(expanded) > 1 and _all_shards(part, expanded):  # one numeric range over shard names:
            if len(parts) == 1:
                return expanded  # nothing to ask of each URL, and nothing made before it is read
            urls += expanded
            continue
        for url in expanded:
            if url.startswith("pipe:") and not allow_pipe:
                raise ValueError(
                    f"pipe: URLs run shell commands and are refused: {redact_url(url)!r}; pass allow_pipe=True to allow them"
                )
            if _is_glob(url):
                urls += glob_urls(url, storage_options=storage_options)
            elif _is_folder(url, single=len(expanded) == 1, storage_options=storage_options):
                found = folder_urls(url, storage_options=storage_options)
                if len(parts) == 1 and len(expanded) == 1:
                    return found  # a folder alone: its compact list
                urls += found
            else:
                urls.append(url)
    if not urls:
        raise ValueError("shard spec expanded to no URLs")
    return urls


def _shard_name(url: str) -> str:
    return url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def _brace_expand(part: str) -> Sequence[str]:
    """``braceexpand``'s list; a pattern whose only braces are one numeric range is a lazy
    :class:`~datapipe.storage.shard_list.NumberedUrls` (a million URLs cost nothing until read)."""
    m = _RANGE.search(part)
    if m is not None and "{" not in part[:m.start()] + part[m.end():] and "}" not in part[:m.start()] + part[m.end():]:
        lo, hi = m.group(1), m.group(2)
        padded = lo.startswith("0") and len(lo) > 1 or hi.startswith("0") and len(hi) > 1
        if len(lo) == len(hi) or not padded:
            width = len(lo) if padded else 0
            head, tail = part[:m.start()], part[m.end():]
            from datapipe.storage.shard_list import NumberedUrls

            return NumberedUrls(head, int(lo), int(hi), width, tail)
    return list(braceexpand.braceexpand(part))


def _all_shards(part: str, expanded: list[str]) -> bool:
    """Whether every URL of ``part``'s numeric range is a plain shard name (no pipe, glob or folder): the range is
    the pattern's only brace, and the first and last URL end in a shard suffix (only digits vary)."""
    m = _RANGE.search(part)
    if m is None or "{" in part[m.end():] or "{" in part[:m.start()] or expanded[0].startswith("pipe:"):
        return False
    if (_HTTP_GLOB if url_scheme(part) in ("http", "https") else _GLOB).search(part.split("?", 1)[0]
                                                                             if url_scheme(part) in ("http", "https")
                                                                             else part):
        return False
    suffixes = SHARD_SUFFIXES + _COMPRESSED
    return _shard_name(expanded[0]).endswith(suffixes) and _shard_name(expanded[-1]).endswith(suffixes) \
        and "/" not in part[m.end():].split("?", 1)[0]


def _is_folder(url: str, *, single: bool, storage_options: dict | None) -> bool:
    """Whether ``url`` names a folder: a local stat; remotely one listing, only for a spec's single URL. A name
    with a shard's suffix in a spec of many URLs is taken for a shard, unlisted."""
    if url.startswith("pipe:"):
        return False
    name = _shard_name(url)
    if not single and name.endswith(SHARD_SUFFIXES + _COMPRESSED):
        return False
    if is_local(url):
        return os.path.isdir(local_path(url))
    if not single or name.endswith(SHARD_SUFFIXES + _COMPRESSED):
        return False
    try:
        from datapipe.storage.files import filesystem

        fs, path = filesystem(url, storage_options)
        if url_scheme(url) in ("http", "https"):
            if url.split("?", 1)[0].endswith("/"):
                return True
            # HEAD (redirects followed): a folder answers with its listing page, a shard with its bytes
            return fs.info(path).get("mimetype") in ("text/html", "application/xhtml+xml")
        return bool(fs.isdir(path))
    except Exception:  # not listable (or no access): reading it as a shard says what is wrong
        return False


def _is_glob(url: str) -> bool:
    """Whether ``url`` holds a glob character (``*``, ``?``, ``[``): in an http(s) URL's path only, and ``?``
    not at all there (it starts the query); a local path that exists as written is no glob."""
    if url.startswith("pipe:"):
        return False
    if url_scheme(url) in ("http", "https"):
        return bool(_HTTP_GLOB.search(url.split("?", 1)[0]))
    if not _GLOB.search(url):
        return False
    return not (is_local(url) and os.path.exists(local_path(url)))


def glob_urls(url: str, *, storage_options: dict | None = None) -> list[str]:
    """The files that the glob ``url`` matches (through fsspec; local paths keep their form), in name order."""
    if is_local(url):
        import glob

        prefix = "file://" if url.startswith("file://") else ""
        found = [prefix + p for p in glob.glob(local_path(url)) if not os.path.isdir(p)]
    else:
        from datapipe.storage.files import filesystem

        try:
            fs, path = filesystem(url, storage_options)
            matches = [p for p, info in fs.glob(path, detail=True).items() if info.get("type") != "directory"]
        except (OSError, ValueError) as e:
            raise DataError(f"cannot list the files that the glob pattern matches: {type(e).__name__}: {e}",
                            url=redact_url(url), what="glob") from e
        stripped = fs._strip_protocol(url)
        head = url[:-len(stripped)] if stripped and url.endswith(stripped) else None
        found = [p if "://" in p else (head + p if head is not None else fs.unstrip_protocol(p)) for p in matches]
    if not found:
        raise DataError("the glob pattern matches no file: check the folder and the pattern (a folder URL reads "
                        "all the shards of its folder, e.g. 'data/shards/')", url=redact_url(url), what="glob")
    return sorted(found)


def folder_urls(url: str, *, storage_options: dict | None = None) -> Sequence[str]:
    """The shards of the folder ``url``: its manifest's (a :class:`ShardList` with their counts), else its
    ``.tar`` files in name order."""
    from datapipe.storage.files import filesystem
    from datapipe.storage.shard_list import ShardList
    from datapipe.tar.manifest import MANIFEST_NAME, read_columns

    base = url.rstrip("/") or url
    columns = read_columns(base, storage_options=storage_options)
    if columns is not None:
        if not columns.counts:
            raise DataError(f"the folder's {MANIFEST_NAME} lists no shards", url=redact_url(url), what="folder")
        return ShardList(base, columns.names, columns.starts, counts=columns.counts, checksums=columns.checksums,
                         known_fingerprint=columns.fingerprint)
    else:
        try:
            if is_local(url):
                found = os.listdir(local_path(base))
            else:
                fs, path = filesystem(url, storage_options)
                if url_scheme(url) in ("http", "https") and not path.split("?", 1)[0].endswith("/"):
                    path += "/"  # the listing page's links are relative to the folder itself
                found = [_shard_name(p) for p in fs.ls(path, detail=False)]
        except OSError as e:
            from datapipe.storage.failures import is_missing

            if is_missing(e):  # as a folder named without its slash is said not to exist (read.shards)
                raise DataError(f"no such folder: {redact_url(url)}: {folder_advice(url)}", url=redact_url(url),
                                what="folder") from None
            raise DataError(f"cannot list the folder: {type(e).__name__}: {e}", url=redact_url(url),
                            what="folder") from e
        names = sorted(n for n in found if n.endswith(SHARD_SUFFIXES))
        if not names:
            raise DataError(f"the folder holds no {MANIFEST_NAME} and no .tar shards: give a folder of shards "
                            "(e.g. the OUT of `datapipe shard`) or a shard pattern like 'data/shard-{000000..000009}.tar'",
                            url=redact_url(url), what="folder")
    return [posixpath.join(base, n) for n in names]


def folder_advice(url: str) -> str:
    """What to check about a folder ``url`` that does not exist: the path, or the shards' pattern or glob."""
    relative = is_local(url) and not os.path.isabs(local_path(url))
    where = f" (relative to the current directory, {os.getcwd()})" if relative else ""
    base = redact_url(url.rstrip("/" + os.sep) or url)
    return (f"check the path{where}, or give the shards by a pattern like '{base}/shard-{{000000..000009}}.tar' "
            f"or a glob like '{base}/*.tar'")


def _check_padding(part: str, expanded: list[str]) -> None:
    """A range without zero padding (``{0..6}``) whose first local file is missing while a zero-padded
    name exists (``shard-000000.tar``): ``DataError`` naming the padded range to write."""
    m = _RANGE.search(part)
    if m is None or not is_local(expanded[0]) or os.path.exists(local_path(expanded[0])):
        return
    lo, hi = m.group(1), m.group(2)
    if lo != str(int(lo)):  # already padded
        return
    for width in range(len(hi) + 1, 11):
        padded = f"{{{int(lo):0{width}d}..{int(hi):0{width}d}}}"
        candidate = part[:m.start()] + padded + part[m.end():]
        first = next(iter(braceexpand.braceexpand(candidate)))
        if os.path.exists(local_path(first)):
            raise DataError(f"no file {expanded[0]!r}, but {first!r} exists: the names are zero-padded, write "
                            f"{padded} instead of {m.group(0)}", url=redact_url(part))


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


