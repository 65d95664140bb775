"""The options of ``datapipe shard``: :class:`ShardOptions` (with its image and text groups), their checks,
and the error that says one is wrong (exit status 2)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from datapipe.jobs.shard.sources import KINDS
from datapipe.jobs.shard.usage import UsageError

ENGINES = ("local", "ray")
CHECKS = ("open", "decode", "none")


def image_check(value: str | bool) -> str:
    """Normalise ``check_images``: ``"open"`` (default), ``"decode"``, ``"none"``; True/False mean decode/none."""
    if value is True or value is False:
        return "decode" if value else "none"
    if value not in CHECKS:
        raise UsageError(f"--check-images must be one of {', '.join(CHECKS)}, got {value!r}")
    return value


def _positive_int(value, name: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ImageOptions:
    """What the job does to images.

    Args:
        check: ``"open"`` (default: PIL reads the header, and JPEG / PNG files must end with their end
            marker, so truncated files are caught without a decode), ``"decode"`` (every pixel decoded),
            ``"none"`` (bytes copied unchecked: unsafe). True / False mean ``"decode"`` / ``"none"``.
        resize: shrink images to this shorter side (pixels); implies a re-encode as JPEG.
        quality: re-encode images as JPEG of this quality (1-100).
    """

    check: str = "open"
    resize: int | None = None
    quality: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "check", image_check(self.check))
        if self.resize is not None:
            _positive_int(self.resize, "--resize (a shorter-side length in pixels)")
        if self.quality is not None and (isinstance(self.quality, bool) or not isinstance(self.quality, int)
                                         or not 1 <= self.quality <= 100):
            raise UsageError(f"--quality must be between 1 and 100, got {self.quality!r}")


@dataclass(frozen=True)
class TextOptions:
    """How JSONL / Parquet text is read and tokenised.

    Args:
        text_field: the record field holding the text (default ``"text"``).
        key_field: the record field to use as sample key (default: file and byte offset / row).
        tokenizer: ``"byte"`` (UTF-8 bytes as ids) or a Hugging Face ``tokenizer.json`` path: the
            token ids are stored beside the text as an int32 ``.npy`` entry (no EOS is added).
    """

    text_field: str | None = None
    key_field: str | None = None
    tokenizer: str | None = None

    def __post_init__(self):
        tok = self.tokenizer
        if tok is not None and (not isinstance(tok, str) or (tok != "byte" and not tok.endswith(".json"))):
            raise UsageError(f"--tokenizer must be 'byte' or a tokenizer.json path, got {tok!r}")
        if tok is not None and tok != "byte" and "://" not in tok and not os.path.isfile(tok):
            raise UsageError(f"--tokenizer {tok!r}: no such file (give the path of a Hugging Face tokenizer.json, "
                             "or 'byte')")


@dataclass(frozen=True)
class ShardOptions:
    """What ``datapipe shard`` writes: shard limits and names, order, checks and transforms.

    Args:
        kind: what the input is: ``"auto"`` (guess), ``"images"``, ``"list"``, ``"text"``, ``"tar"``.
        pattern: shard file names, one integer placeholder (``"shard-%06d.tar"``).
        max_bytes / max_count: a shard ends before it passes either limit.
        shuffle / seed: shuffle the samples across the input (the default; seeded, deterministic for a given
            seed); ``shuffle=False`` keeps the input order.
        index: also write DALI index files (``.idx``) beside the shards.
        strict: fail on the first unreadable input item (otherwise skip it and list it in the report).
        overwrite: replace the shards of an earlier job in OUT (without it they are an error).
        partition_size: input items per partition (default: about two shards' worth).
        partition_bytes: JSONL bytes per partition.
        images: :class:`ImageOptions` (check, resize, re-encode).
        text: :class:`TextOptions` (fields, tokenizer).
    """

    kind: str = "auto"
    pattern: str = "shard-%06d.tar"
    max_bytes: int = 1 << 30
    max_count: int = 100_000
    shuffle: bool = True
    seed: int = 0
    index: bool = False
    strict: bool = False
    overwrite: bool = False
    partition_size: int | None = None
    partition_bytes: int = 32 << 20
    images: ImageOptions = field(default_factory=ImageOptions)
    text: TextOptions = field(default_factory=TextOptions)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UsageError(f"--input-kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("max_bytes", "max_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--max-bytes and --max-count must be positive, got {name}={value!r}")
        check_pattern(self.pattern)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"--seed must be an integer, got {self.seed!r}")
        _positive_int(self.partition_size, "--partition-size", optional=True)
        _positive_int(self.partition_bytes, "--partition-bytes")
        if not isinstance(self.images, ImageOptions):
            raise UsageError(f"images must be an ImageOptions(...), got {type(self.images).__name__}")
        if not isinstance(self.text, TextOptions):
            raise UsageError(f"text must be a TextOptions(...), got {type(self.text).__name__}")


def check_pattern(pattern: str) -> None:
    """Raise :class:`UsageError` unless ``pattern`` is a ``.tar`` file name with one integer placeholder."""
    if not isinstance(pattern, str) or "/" in pattern or not pattern.endswith(".tar"):
        raise UsageError(f"--pattern {pattern!r} must be a file name ending in .tar, e.g. 'shard-%06d.tar'")
    try:
        same = pattern % 0 == pattern % 1
    except (TypeError, ValueError) as e:
        raise UsageError(f"--pattern {pattern!r} needs one integer placeholder such as %06d") from e
    if same:
        raise UsageError(f"--pattern {pattern!r} needs one integer placeholder such as %06d")


def check_run(*, engine: str, workers: int) -> None:
    """Raise :class:`UsageError` for an unknown engine or a worker count below 1."""
    if engine not in ENGINES:
        raise UsageError(f"--engine must be 'local' or 'ray', got {engine!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers!r}")
