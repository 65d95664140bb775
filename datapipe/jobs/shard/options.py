"""The options of ``datapipe shard``: their checks, and the error that says one is wrong (exit status 2)."""
from __future__ import annotations

from datapipe.jobs.shard.sources import KINDS

ENGINES = ("local", "ray")


class UsageError(ValueError):
    """A mistake in how the job was asked for (exit status 2)."""


CHECKS = ("open", "decode", "none")


def image_check(value: str | bool) -> str:
    """Normalise ``check_images``: ``"open"`` (default), ``"decode"``, ``"none"``; True/False mean decode/none."""
    if value is True or value is False:
        return "decode" if value else "none"
    if value not in CHECKS:
        raise UsageError(f"--check-images must be one of {', '.join(CHECKS)}, got {value!r}")
    return value


def check_options(*, kind, max_bytes, max_count, pattern, resize, quality, workers, engine, partition_size,
                  partition_bytes, tokenizer) -> None:
    """Raise :class:`UsageError` naming the first option that is out of range."""
    if kind not in KINDS:
        raise UsageError(f"--input-kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if engine not in ENGINES:
        raise UsageError(f"--engine must be 'local' or 'ray', got {engine!r}")
    if max_bytes <= 0 or max_count <= 0:
        raise UsageError("--max-bytes and --max-count must be positive")
    if "/" in pattern or not pattern.endswith(".tar"):
        raise UsageError(f"--pattern {pattern!r} must be a file name ending in .tar, e.g. 'shard-%06d.tar'")
    try:
        pattern % 0
    except (TypeError, ValueError) as e:
        raise UsageError(f"--pattern {pattern!r} needs one integer placeholder such as %06d") from e
    if pattern % 0 == pattern % 1:
        raise UsageError(f"--pattern {pattern!r} needs one integer placeholder such as %06d")
    if resize is not None and resize < 1:
        raise UsageError("--resize must be a positive shorter-side length in pixels")
    if quality is not None and not 1 <= quality <= 100:
        raise UsageError("--quality must be between 1 and 100")
    if workers < 1:
        raise UsageError("--workers must be >= 1")
    if partition_size is not None and partition_size < 1:
        raise UsageError("--partition-size must be >= 1")
    if partition_bytes < 1:
        raise UsageError("--partition-bytes must be >= 1")
    if tokenizer is not None and tokenizer != "byte" and not tokenizer.endswith(".json"):
        raise UsageError(f"--tokenizer must be 'byte' or a tokenizer.json path, got {tokenizer!r}")
