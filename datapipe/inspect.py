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
from datapipe.manifest import read_manifest
from datapipe.storage import open_shard
from datapipe.tario import TarFormatError, iter_samples, reader_for
from datapipe.urls import expand_urls, redact_url


def shard_urls(target: str) -> tuple[list[str], dict | None]:
    """The shards a target names: a spec of shard URLs, or a directory (with or without a manifest)."""
    if target.endswith((".tar", ".tar.gz", ".tgz")) or "{" in target or "::" in target:
        return expand_urls(target), None
    manifest = read_manifest(target)
    if manifest is not None:
        return [posixpath.join(target.rstrip("/"), s["name"]) for s in manifest["shards"]], manifest
    fs, path = fsspec.core.url_to_fs(target)
    names = sorted(p for p in fs.ls(path, detail=False) if p.endswith((".tar", ".tar.gz", ".tgz")))
    prefix = target.split("://", 1)[0] + "://" if "://" in target else ""
    return [prefix + n if prefix and not n.startswith(prefix) else n for n in names], None


def inspect_shards(target: str, *, preview: int = 1) -> dict[str, Any]:
    """Walk every shard fully; report counts per shard, extensions, sizes, problems and a preview."""
    urls, manifest = shard_urls(target)
    expected = {s["name"]: s["count"] for s in manifest["shards"]} if manifest else {}
    report: dict[str, Any] = {"target": redact_url(target), "shards": [], "samples": 0, "bytes": 0,
                              "extensions": Counter(), "problems": [], "preview": []}
    for url in urls:
        entry = {"url": redact_url(url), "samples": 0, "bytes": 0}
        try:
            f, seekable = open_shard(url)
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
                        report["preview"].append({k: _preview(v) for k, v in event.sample.items()})
            finally:
                f.close()
        except (DataError, TarFormatError) as e:
            report["problems"].append(f"{redact_url(url)}: {e}")
        name = posixpath.basename(url)
        if name in expected and expected[name] != entry["samples"]:
            report["problems"].append(f"{redact_url(url)}: {entry['samples']} samples, manifest says {expected[name]}")
        report["shards"].append(entry)
        report["samples"] += entry["samples"]
        report["bytes"] += entry["bytes"]
    report["extensions"] = dict(report["extensions"])
    report["manifest"] = manifest is not None
    return report


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


def run_command(args: argparse.Namespace) -> int:
    try:
        report = inspect_shards(args.target, preview=args.preview)
    except (OSError, ValueError, DataError) as e:
        print(f"datapipe inspect: cannot read {redact_url(args.target)}: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
    else:
        print(f"{report['target']}: {len(report['shards'])} shards, {report['samples']} samples, "
              f"{report['bytes'] / 1e6:.1f} MB of values, manifest: {'yes' if report['manifest'] else 'no'}")
        print("extensions: " + ", ".join(f"{k} ({v})" for k, v in sorted(report["extensions"].items())))
        for sample in report["preview"]:
            print("preview: " + ", ".join(f"{k}={v}" for k, v in sample.items()))
        for problem in report["problems"]:
            print(f"PROBLEM {problem}")
    return 1 if report["problems"] else 0
