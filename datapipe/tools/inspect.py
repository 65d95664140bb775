"""``datapipe inspect``: a summary of shards (samples, keys, extensions, sizes, a preview); exit 1 if corrupt."""
from __future__ import annotations

import argparse
import json
import posixpath
import sys
from collections import Counter
from typing import Any

import fsspec

from datapipe.errors import DataError
from datapipe.tar.manifest import read_manifest
from datapipe.storage.failures import is_missing
from datapipe.storage.files import describe, is_permanent, open_shard, secrets_of
from datapipe.tar.blocks import reader_for
from datapipe.tar.headers import BLOCK, TarFormatError, _checksum_ok
from datapipe.tar.reader import iter_samples
from datapipe.storage.urls import expand_urls, folder_advice, redact_text, redact_url
from datapipe.words import counted


_WHAT = "give a shard, a brace pattern of shards or a shard directory"


def shard_urls(target: str, *, storage_options: dict | None = None) -> list[str]:
    """The shards a target names, listed as ShardStream lists them (:func:`datapipe.storage.urls.expand_urls`): a
    spec of shard URLs, a folder (the shards its manifest lists, else its shard files) or a single file, which
    must exist and be a tar."""
    options = storage_options or {}
    urls = expand_urls(target, storage_options=options)
    if urls != [target]:
        return urls
    fs, path = fsspec.core.url_to_fs(target, **options)
    try:
        fs.info(path)
    except Exception as e:  # fsspec's HTTP reports an unreachable host as FileNotFoundError too
        if isinstance(e, FileNotFoundError) and is_permanent(e):
            if not target.rstrip("/").endswith((".tar", ".tgz", ".tar.gz", ".gz")):  # a folder, as ShardStream says
                raise FileNotFoundError(f"no such folder: {redact_url(target)}: {folder_advice(target)}") from None
            raise FileNotFoundError(f"{redact_url(target)} does not exist: {_WHAT}") from None
        text, cause = describe(e, secrets_of(target, options))
        raise DataError(f"cannot read: {text}", url=redact_url(target), what="target") from cause
    with fs.open(path, "rb") as f:
        head = f.read(BLOCK)
    if len(head) < BLOCK or not _checksum_ok(head):
        raise ValueError(f"{redact_url(target)} is neither a tar file nor a directory: {_WHAT}")
    return urls


def inspect_shards(target: str, *, preview: int = 1, storage_options: dict | None = None) -> dict[str, Any]:
    """Walk every shard fully; report counts per shard, extensions, sizes, problems and a preview.

    ``manifest``: whether the manifests beside the shards list every one of them and the shards cover every
    shard they list (``manifest_lists``: how many of the shards they list, by the rule ShardStream counts them
    by; ``manifest_shards`` / ``manifest_samples``: how many shards and samples those manifests list in all). A
    shard whose sample count differs from its entry is a problem.
    """
    urls = shard_urls(target, storage_options=storage_options)
    expected, listed, skipped, checks = _manifest_counts(urls, storage_options=storage_options)
    report: dict[str, Any] = {"target": redact_url(target), "shards": [], "samples": 0, "bytes": 0,
                              "extensions": Counter(), "problems": [], "preview": []}
    for url in urls:
        entry = {"url": redact_url(url), "samples": 0, "bytes": 0}
        try:
            f, seekable = open_shard(url, storage_options=storage_options)
            try:
                for event in iter_samples(reader_for(f, seekable=seekable), url, resync=True):
                    if event.sample is None:
                        report["problems"].append(f"{redact_url(url)}: {event.key or '?'}: {event.error}")
                        continue
                    entry["samples"] += 1
                    for ext, value in event.sample.items():
                        if not ext.startswith("__"):
                            report["extensions"][ext] += 1
                            entry["bytes"] += len(value)
                    if len(report["preview"]) < preview:
                        report["preview"].append({k: redact_url(v) if k == "__url__" else _preview(v)
                                                  for k, v in event.sample.items()})
            finally:
                f.close()
        except (DataError, TarFormatError) as e:
            if e.__cause__ is not None and is_missing(e.__cause__):
                entry["missing"] = True
                report["problems"].append(f"{redact_url(url)}: the shard does not exist")
            else:
                report["problems"].append(f"{redact_url(url)}: {redact_text(e)}")
        if url in expected:
            entry["expected"] = expected[url]
        if url in expected and expected[url] != entry["samples"]:
            report["problems"].append(f"{redact_url(url)}: {counted(entry['samples'], 'sample')}, manifest says {expected[url]}")
        report["shards"].append(entry)
        report["samples"] += entry["samples"]
        report["bytes"] += entry["bytes"]
    report["extensions"] = dict(report["extensions"])
    report["missing"] = sum(1 for s in report["shards"] if s.get("missing"))  # named by the target, not there
    report["manifest_lists"] = len(expected)
    report["manifest_shards"] = len(listed)
    report["manifest_samples"] = sum(listed.values())
    report["manifest_skipped"] = skipped  # inputs the shard job skipped (its report.json lists them); None: not said
    report["manifest_check_images"] = checks  # the shard jobs' --check-images modes ([]: not said)
    report["manifest"] = bool(urls) and len(expected) == len(urls) == len(listed)
    return report


def _manifest_counts(urls: list[str], *,
                     storage_options: dict | None) -> tuple[dict[str, int], dict[str, int], int | None, list[str]]:
    """The sample counts of those of ``urls`` that a manifest beside them lists, and of every shard those
    manifests list (by URL); the inputs their shard jobs skipped (``num_skipped``; None where none says); and
    the image checks those jobs ran (``check_images``, each mode once)."""
    by_dir: dict[str, list[str]] = {}
    for url in urls:
        by_dir.setdefault(posixpath.dirname(url), []).append(url)
    expected: dict[str, int] = {}
    listed: dict[str, int] = {}
    skipped = None
    checks: set[str] = set()
    for directory, dir_urls in by_dir.items():
        manifest = read_manifest(directory, storage_options=storage_options)
        if manifest is None:
            continue
        if isinstance(manifest.get("num_skipped"), int):
            skipped = (skipped or 0) + manifest["num_skipped"]
        if isinstance(manifest.get("check_images"), str):
            checks.add(manifest["check_images"])
        known = {s["name"]: int(s["count"]) for s in manifest["shards"]}
        listed.update({posixpath.join(directory, name): n for name, n in known.items()})
        for url in dir_urls:
            name = posixpath.basename(url)
            if name in known:
                expected[url] = known[name]
    return expected, listed, skipped, sorted(checks)


def _manifest_line(report: dict) -> str:
    """``yes, all 5 of its shards (400 samples)``; ``4 of its 5 shards (397 of 400 samples) match this pattern``;
    ``lists 2 of 3 shards`` (the others are counted by the stream); ``no``."""
    lists, total = report["manifest_lists"], len(report["shards"])
    shards, samples = report["manifest_shards"], report["manifest_samples"]
    if not lists:
        return "no"
    if report["manifest"]:
        return (f"yes, all {shards} of its shards ({counted(samples, 'sample')})" if shards != 1 else
                f"yes, its one shard ({counted(samples, 'sample')})")
    parts = []
    if lists < shards:
        covered = sum(s["expected"] for s in report["shards"] if "expected" in s)
        parts.append(f"{lists} of its {counted(shards, 'shard')} ({covered} of {counted(samples, 'sample')}) "
                     f"{'matches' if lists == 1 else 'match'} this pattern")
    if lists < total:
        parts.append(f"lists {lists} of {counted(total, 'shard')}")
    return "; ".join(parts)


def _shards_headline(report: dict) -> str:
    """``6 shards``; ``6 shards named, 2 of them do not exist`` (a pattern longer than what is there)."""
    total, missing = len(report["shards"]), report.get("missing", 0)
    if not missing:
        return counted(total, "shard")
    if missing == total:
        return "1 shard named, it does not exist" if total == 1 else f"{total} shards named, none of them exists"
    return f"{counted(total, 'shard')} named, {missing} of them {'does' if missing == 1 else 'do'} not exist"


def _preview(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value[:64])
        try:
            text = raw.decode("utf-8")
            if text.isprintable():
                return text if len(value) <= 64 else text + f"... ({len(value)} bytes)"
        except UnicodeDecodeError:
            pass
        return f"<{len(value)} bytes: {raw[:16].hex()}...>"
    return value


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a shard directory, a shard URL, or a brace spec of shards")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--preview", type=int, default=1, help="samples to preview (default 1)")
    parser.add_argument("--storage-options", default=None,
                        help='fsspec options as JSON (credentials, endpoints), e.g. '
                             '\'{"key": "...", "secret": "...", "client_kwargs": {"endpoint_url": "http://..."}}\'')


def run_command(args: argparse.Namespace) -> int:
    try:
        options = json.loads(args.storage_options) if args.storage_options else None
        if options is not None and not isinstance(options, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        print(f"datapipe inspect: --storage-options must be a JSON object ({e})", file=sys.stderr)
        return 2
    try:
        report = inspect_shards(args.target, preview=args.preview, storage_options=options)
    except (OSError, ValueError, DataError) as e:
        text = redact_text(e)
        text = text if redact_url(args.target) in text else f"cannot read {redact_url(args.target)}: {text}"
        print(f"datapipe inspect: {text}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
    else:
        print(f"{report['target']}: {_shards_headline(report)}, {counted(report['samples'], 'sample')}, "
              f"{report['bytes'] / 1e6:.1f} MB of values, manifest: {_manifest_line(report)}")
        unchecked = "none" in report["manifest_check_images"]
        if unchecked:
            some = " of some shard folders" if len(report["manifest_check_images"]) > 1 else ""
            print(f"images{some} not checked when sharded (--check-images none)")
        if report["manifest_skipped"] is not None and not (unchecked and report["manifest_skipped"] == 0):
            print(f"skipped when sharded: {counted(report['manifest_skipped'], 'unreadable input')} (the manifest's "
                  "num_skipped; the shard job's report.json lists them)")
        print("extensions: " + ", ".join(f"{k} ({v})" for k, v in sorted(report["extensions"].items())))
        for sample in report["preview"]:
            print("preview: " + ", ".join(f"{k}={v}" for k, v in sample.items()))
        for problem in report["problems"]:
            print(f"PROBLEM {problem}")
    return 1 if report["problems"] else 0
