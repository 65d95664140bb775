"""How many samples each shard of a ``ShardStream`` holds: given counts, the manifest, the count cache,
or counted once by walking the shard's headers (damaged shards count their complete samples)."""
from __future__ import annotations

import logging
import posixpath

from datapipe.errors import DataError
from datapipe.storage.urls import redact_url
from datapipe.tar.blocks import reader_for
from datapipe.tar.counts import _map, load_counts, stamp, store_counts
from datapipe.tar.manifest import read_manifest
from datapipe.tar.reader import count_until_damage

# the stream's own logger (its count warning keeps its name); getChild, as the name is no module import
log = logging.getLogger("datapipe").getChild("stream")


class ShardCounts:
    """``ShardStream``'s sample counts per shard (a mixin: the state lives on the stream)."""

    def _given_counts(self, counts) -> list[int] | None:
        if counts is None:
            return None
        if isinstance(counts, dict):
            missing = [u for u in self.urls if u not in counts]
            if missing:
                raise ValueError(f"counts has no entry for {redact_url(missing[0])}")
            return [int(counts[u]) for u in self.urls]
        if len(counts) != len(self.urls):
            raise ValueError(f"counts has {len(counts)} entries for {len(self.urls)} shards")
        return [int(c) for c in counts]

    def _manifest_entries(self) -> dict[str, dict]:
        """The manifest entry (count, sha256, ...) of each URL that a manifest beside it lists."""
        if self._manifest is None:
            entries: dict[str, dict] = {}
            by_dir: dict[str, list[str]] = {}
            for url in self.urls:
                if not url.startswith("pipe:"):
                    by_dir.setdefault(posixpath.dirname(url), []).append(url)
            for directory, dir_urls in by_dir.items():
                manifest = read_manifest(directory, storage_options=self._options(dir_urls[0]), retries=self.retries,
                                         backoff=self.backoff)
                if manifest is None:
                    continue
                known = {s["name"]: s for s in manifest["shards"]}
                for url in dir_urls:
                    entry = known.get(posixpath.basename(url))
                    if entry is not None:
                        entries[url] = entry
            self._manifest = entries
        return self._manifest

    def _checksum(self, url: str) -> str | None:
        entry = self._manifest_entries().get(url) if self._cache is not None else None
        return (entry or {}).get("sha256") or None

    @property
    def counts(self) -> list[int]:
        """Samples per shard: from the manifest, else from the count cache, else counted once (and cached).

        A damaged shard without a manifest counts its complete samples before the damage.
        """
        if self._counts is None:
            known = {u: int(e["count"]) for u, e in self._manifest_entries().items()}
            missing = [u for u in self.urls if u not in known and not u.startswith("pipe:")]
            cached = load_counts(missing, storage_options=self._options(missing[0])) if missing else {}
            for url, entry in cached.items():
                known[url] = entry["count"]
                if entry.get("damage"):
                    self._damaged(url, entry["damage"])
            missing = [u for u in self.urls if u not in known]
            if missing:
                log.warning("no manifest lists %d of %d shards: counting their samples once (write shards with "
                            "datapipe.ShardWriter, or run `datapipe index` on them once to store their counts)",
                            len(missing), len(self.urls))
                results = _map(self._count_shard, missing, desc="counting samples")
                fresh = {}
                for url, (n, damage, mark) in zip(missing, results):
                    known[url] = n
                    if mark is not None:
                        fresh[url] = {"count": n, "damage": damage, "stamp": mark}
                if fresh:
                    store_counts(fresh, storage_options=self._options(missing[0]))
            self._counts = [known[u] for u in self.urls]
        return self._counts

    def _count_shard(self, url: str) -> tuple[int, str | None, dict | None]:
        """``(complete samples, damage message or None, the shard's stamp for the cache or None)``."""
        try:
            version = None if url.startswith("pipe:") else stamp(url, self._options(url))
        except Exception:
            version = None
        try:
            f, seekable, tee = self._open(url)
        except DataError as e:
            self._errors(e, lost=0)
            return 0, None, None
        try:
            n, err = count_until_damage(reader_for(f, seekable=seekable))
            if err is None and tee is not None:
                tee.finish()
        finally:
            f.close()
        if err is None:
            return n, None, version
        damage = f"shard damaged at byte {err.offset}: {err} ({n} complete samples before it are read)"
        self._damaged(url, damage)
        return n, damage, version

    def _damaged(self, url: str, damage: str) -> None:
        self._errors(DataError(damage, url=redact_url(url)), lost=0)
        self._damage[url] = damage
