"""A stream's shards: their URLs, how to open them (read options, cache), and how many samples each holds
(given counts, the manifest, the count cache, or counted once by walking the shard's headers; damaged
shards count their complete samples; one whose storage gives up mid-count is skipped whole, its failure
counted once under ``on_error``)."""
from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re

from datapipe.errors import DataError
from datapipe.read.ledger import Ledger
from datapipe.read.options import StorageOptions
from datapipe.storage.cache import ShardCache
from datapipe.storage.failures import is_missing
from datapipe.storage.files import RetryingFile, decompress, open_shard, with_timeouts
from datapipe.storage.urls import folder_advice, is_local, local_path, redact_url
from datapipe.tar.blocks import reader_for
from datapipe.tar.counts import _map, load_counts, stamp, store_counts
from datapipe.tar.headers import TarFormatError
from datapipe.words import counted, plural
from datapipe.tar.manifest import listed, read_manifest
from datapipe.tar.reader import count_until_damage

# the stream's own logger (its count warning keeps its name)
log = logging.getLogger("datapipe").getChild("stream")
_ABSENT = object()  # a remote shard that does not exist (Shards._absent)


def fingerprint(urls: list[str], counts: list[int], checksums: list[str | None] | None = None) -> str:
    """The identity of a shard list: names (basenames), sample counts and (where a manifest has them) sha256s."""
    checksums = checksums or [None] * len(urls)
    text = "|".join(f"{posixpath.basename(u)}:{c}" + (f":{h}" if h else "")
                    for u, c, h in zip(urls, counts, checksums))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class Shards:
    """The shard list of a stream, opened with ``storage_options`` and ``storage`` (through ``cache`` for remote
    shards), counted into ``ledger``."""

    def __init__(self, urls: list[str], *, storage_options: dict, storage: StorageOptions,
                 cache: ShardCache | None, ledger: Ledger, counts=None):
        self.urls = urls
        self.storage_options = storage_options
        self.storage = storage
        self.cache = cache
        self.ledger = ledger
        self.manifest: dict[str, dict] | None = None
        self.damage: dict[str, str] = {}  # counted shards found damaged: url -> "shard damaged at byte N: ..."
        self._counts = self._given_counts(counts)
        self._given = counts is not None
        self._cache_failures = cache.failures if cache is not None else 0  # the cache's failures counted so far
        self._identity: str | None = None
        self._checksums = False  # the checksums listed() found with the counts (None: none), False: not used
        self._stamps: dict[str, dict] = {}  # remote shards' stamps taken while looking for absent ones

    def _given_counts(self, counts) -> list[int] | None:
        if counts is None:
            return None
        if isinstance(counts, dict):
            missing = [u for u in self.urls if u not in counts]
            if missing:
                raise ValueError(f"counts has no entry for {redact_url(missing[0])}")
            return [int(counts[u]) for u in self.urls]
        if len(counts) != len(self.urls):
            raise ValueError(f"counts has {counted(len(counts), 'entry', 'entries')} for {counted(len(self.urls), 'shard')}: "
                             "give one count per URL")
        return [int(c) for c in counts]

    def options(self, url: str) -> dict:
        """fsspec options for ``url``: ``storage_options`` with the timeout set."""
        return with_timeouts(url, self.storage_options, self.storage.timeout)

    def entries(self) -> dict[str, dict]:
        """The manifest entry (count, sha256, ...) of each URL that a manifest beside it lists."""
        if self.manifest is None:
            entries: dict[str, dict] = {}
            by_dir: dict[str, list[str]] = {}
            for url in self.urls:
                if not url.startswith("pipe:"):
                    by_dir.setdefault(posixpath.dirname(url), []).append(url)
            for directory, dir_urls in by_dir.items():
                manifest = read_manifest(directory, storage_options=self.options(dir_urls[0]),
                                         retries=self.storage.retries, backoff=self.storage.backoff)
                if manifest is None:
                    continue
                known = {s["name"]: s for s in manifest["shards"]}
                for url in dir_urls:
                    entry = known.get(posixpath.basename(url))
                    if entry is not None:
                        entries[url] = entry
            self.manifest = entries
        return self.manifest

    def checksum(self, url: str) -> str | None:
        entry = self.entries().get(url) if self.cache is not None else None
        return (entry or {}).get("sha256") or None

    @property
    def counts(self) -> list[int]:
        """Samples per shard: given, else from the manifest, else from the count cache, else counted once (and cached)."""
        if self._counts is None and getattr(self.urls, "counts", None) is not None:
            self._counts = self.urls.counts  # a folder's ShardList: its manifest's counts, read once
        if self._counts is None and self.manifest is None and self.cache is None:  # one folder's URLs: its columns
            # (with a cache, the manifest's entries are read anyway: their checksums check what it keeps)
            found = listed(self.urls, storage_options=self.options(self.urls[0]), retries=self.storage.retries,
                           backoff=self.storage.backoff) if len(self.urls) > 1 else None
            if found is not None and None not in found[0]:
                self._counts, self._checksums = list(found[0]), found[1]
                self._identity = None if found[2] is None else self._describe(found[2])
        if self._counts is None:
            known = {u: int(e["count"]) for u, e in self.entries().items()}
            missing = [u for u in self.urls if u not in known and not u.startswith("pipe:")]
            cached = load_counts(missing, storage_options=self.options(missing[0])) if missing else {}
            for url, entry in cached.items():
                known[url] = entry["count"]
                if entry.get("damage"):
                    self._damaged(url, entry["damage"])
            missing = [u for u in self.urls if u not in known]
            absent = self._absent(missing)
            if absent:  # said first (under on_error), not after a warning about counting them
                self._said_absent(absent, every=len(absent) == len(self.urls))
                known.update(dict.fromkeys(absent, 0))
                missing = [u for u in missing if u not in known]
            if missing:
                log.warning("no manifest lists %s: counting their samples once (write shards with "
                            "datapipe.ShardWriter, or run `datapipe index` on them once to store their counts)",
                            f"{len(missing)} of {counted(len(self.urls), 'shard')}" if len(self.urls) > 1 else "the shard")
                results = _map(self._count_shard, missing, desc="counting samples")
                fresh = {}
                for url, (n, damage, mark) in zip(missing, results):
                    known[url] = n
                    if mark is not None:
                        fresh[url] = {"count": n, "damage": damage, "stamp": mark}
                if fresh:
                    store_counts(fresh, storage_options=self.options(missing[0]))
            self._counts = [known[u] for u in self.urls]
        return self._counts

    def _absent(self, urls: list[str]) -> list[str]:
        """Those of ``urls`` (to be counted) that do not exist: local paths looked up, remote ones asked once each
        in parallel (the stamp :meth:`_count_shard` stores with the count, kept so that it is not asked twice)."""
        urls = [u for u in urls if not u.startswith("pipe:")]
        absent = [u for u in urls if is_local(u) and not os.path.exists(local_path(u))]
        remote = [u for u in urls if not is_local(u)]

        def look(url):
            try:
                return stamp(url, self.options(url))
            except Exception as e:  # noqa: BLE001 - only "does not exist" is said here; the count says the rest
                return _ABSENT if is_missing(e) else None

        for url, mark in zip(remote, _map(look, remote)):
            if mark is _ABSENT:
                absent.append(url)
            elif mark is not None:
                self._stamps[url] = mark
        gone = set(absent)
        return [u for u in urls if u in gone]

    def _said_absent(self, absent: list[str], *, every: bool) -> None:
        """One error per URL of ``absent`` under ``on_error``: folders (a name with no suffix, or a trailing ``/``)
        said to be no such folder, shards not to exist. When ``every`` URL is absent the stream names no data at
        all: the first message is raised whatever ``on_error`` says (a skip would leave 0 samples, in silence)."""
        is_folder = [u.endswith(("/", os.sep)) or "." not in posixpath.basename(u) for u in absent]
        folders = [u for u, folder in zip(absent, is_folder) if folder]
        files = [u for u, folder in zip(absent, is_folder) if not folder]
        errors = []
        for group, kind in ((folders, "folder"), (files, "shard")):
            if not group:
                continue
            names = ", ".join(redact_url(u) for u in group[:3]) + (", ..." if len(group) > 3 else "")
            if kind == "folder":
                what = f"no such folder: {names}: " + folder_advice(group[0])
            elif len(self.urls) > 1:
                what = (f"{len(group)} of {counted(len(self.urls), 'shard')} {plural(len(group), 'does', 'do')} "
                        f"not exist: {names}") + self._listed_instead(group[0])
            else:
                what = f"the shard does not exist: {names}" + self._listed_instead(group[0])
            errors += [DataError(what, url=redact_url(u), what=kind) for u in group]
        if every:
            raise errors[0]
        for error in errors:
            self.ledger.errors(error, lost=0)

    def _listed_instead(self, url: str) -> str:
        """What the manifest beside a shard that does not exist lists (its pattern), for the error; "" if none."""
        directory = posixpath.dirname(url)
        try:
            manifest = read_manifest(directory, storage_options=self.options(url), retries=0)
        except Exception:  # the error at hand says what matters; this only adds to it
            return ""
        names = sorted(s["name"] for s in (manifest or {}).get("shards", []))
        if not names:
            return ""
        where = f"{directory}/" if directory else ""
        digits = [re.fullmatch(r"(.*?)(\d+)(\D*)", n) for n in names]
        first, last = digits[0], digits[-1]
        if (len(names) > 1 and all(digits) and len({(m.group(1), m.group(3), len(m.group(2))) for m in digits}) == 1
                and int(last.group(2)) - int(first.group(2)) == len(names) - 1):
            shown = f"{where}{first.group(1)}{{{first.group(2)}..{last.group(2)}}}{first.group(3)}"
        else:
            shown = ", ".join(where + n for n in names[:3]) + (", ..." if len(names) > 3 else "")
        return f"; its folder's manifest.json lists {counted(len(names), 'shard')}: {redact_url(shown)}"

    def identity(self) -> str:
        """What a checkpoint records of these shards: their number, samples and :func:`fingerprint` (computed once)."""
        if self._identity is None:
            quick = getattr(self.urls, "fingerprint", None)  # a folder's ShardList: a block at a time
            digest = quick(self.counts) if quick is not None and not self._given else None
            if digest is None and self._checksums is not False and not self._given:  # counted by listed()
                digest = fingerprint(self.urls, self.counts, self._checksums)
            if digest is None:
                entries = {} if self._given else self.entries()  # given counts: no manifest is read
                digest = fingerprint(self.urls, self.counts,
                                     [(entries.get(u) or {}).get("sha256") or None for u in self.urls])
            self._identity = self._describe(digest)
        return self._identity

    def _describe(self, digest: str) -> str:
        return f"{len(self.urls)} shards, {sum(self.counts)} samples, {digest}"

    def _count_shard(self, url: str) -> tuple[int, str | None, dict | None]:
        """``(complete samples, damage message or None, the shard's stamp for the cache or None)``."""
        version = self._stamps.pop(url, None)
        try:
            if version is None and not url.startswith("pipe:"):
                version = stamp(url, self.options(url))
        except Exception:
            version = None
        try:
            f, seekable, tee = self.open(url, counted=False)
        except DataError as e:
            self.ledger.errors(e, lost=0)
            return 0, None, None
        try:
            n, err = count_until_damage(reader_for(f, seekable=seekable), read_errors=(DataError, OSError))
            if err is None and tee is not None:
                tee.finish()
        finally:
            f.close()
        if err is None:
            return n, None, version
        if not isinstance(err, TarFormatError):  # the storage gave up mid-count: a shard read once per policy
            self._unreadable(url, n, err)
            return 0, None, None  # not cached: another run counts it again
        damage = f"shard damaged at byte {err.offset}: {err} ({n} complete samples before it are read)"
        self._damaged(url, damage)
        return n, damage, version

    def _unreadable(self, url: str, n: int, err: BaseException) -> None:
        """A read that failed while counting ``url`` (after ``n`` complete samples): one error under ``on_error``,
        the ``n`` samples seen lost; the shard counts 0 samples, so the read pass never opens it (and never
        reports the failure again)."""
        text = str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}"
        where = f" (shard {getattr(err, 'url', None)})"
        if text.endswith(where):  # named once, below
            text = text[:-len(where)]
        failure = DataError(f"counting its samples failed after {n} complete samples, so the shard is skipped "
                            f"whole: {text}", url=redact_url(url))
        failure.__cause__ = err
        self.ledger.errors(failure, lost=n)

    def _damaged(self, url: str, damage: str) -> None:
        self.ledger.errors(DataError(damage, url=redact_url(url)), lost=0)
        self.damage[url] = damage

    def open(self, url: str, *, counted: bool = True):
        """``(file, seekable, tee)``: the shard from the cache or storage; ``tee`` is set while caching it.
        ``counted=False`` (the main process counting samples): its cache hits and retries are not counted."""
        read = self.storage
        if self.cache is None or is_local(url) or url.startswith("pipe:"):
            f, seekable = open_shard(url, storage_options=self.options(url), retries=read.retries,
                                     allow_pipe=read.allow_pipe, backoff=read.backoff)
            return f, seekable, None
        options = self.options(url)
        fetched = []  # the remote files the cache opened: those it read to the end are closed already

        def remote():
            fetched.append(RetryingFile(url, storage_options=options, retries=read.retries, backoff=read.backoff))
            return fetched[-1]

        raw, hit = self.cache.open(url, remote, sha256=self.checksum(url))
        if counted:  # the retries of a verified fetch (the file returned is the cached copy); close() counts raw's
            live = getattr(raw, "remote", raw)
            self.ledger.counts["retries"] += sum(r.retried for r in fetched if r is not live)
            self.ledger.counts["cache_hits"] += hit
        self.count_cache_failures()
        f, seekable = decompress(url, raw, seekable=raw.seekable())
        return f, seekable, (raw if hasattr(raw, "finish") else None)

    def count_cache_failures(self, *, counted: bool = True) -> None:
        """Count the cache's new failures (full disk, no permission...) in the ledger; ``counted=False`` only
        marks them as seen (a worker's copy: its parent counted those)."""
        if self.cache is None:
            return
        new = self.cache.failures - self._cache_failures
        self._cache_failures = self.cache.failures
        if counted:
            self.ledger.counts["cache_failures"] += new

    def close(self, f, reader) -> None:
        """Close a shard, counting the bytes it gave and the retries its reads took."""
        counts = self.ledger.counts
        counts["bytes_read"] += reader.offset
        counts["retries"] += getattr(getattr(f, "myfileobj", None) or f, "retried", 0)
        self.count_cache_failures()
        if hasattr(reader, "close"):
            reader.close()
        f.close()
