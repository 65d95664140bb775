"""``datapipe shard``: convert image folders, path lists, JSONL/Parquet text or tars into WebDataset shards.

``shard(src, out, ShardOptions(...), *, engine, workers, progress, storage_options)`` runs a job (see
:mod:`datapipe.jobs.shard.job`); the options are :class:`ShardOptions` with its :class:`ImageOptions`
and :class:`TextOptions` groups.
"""
from datapipe.jobs.shard.job import shard
from datapipe.jobs.shard.lock import LockedError
from datapipe.jobs.shard.options import ImageOptions, ShardOptions, TextOptions, UsageError

__all__ = ["ImageOptions", "LockedError", "ShardOptions", "TextOptions", "UsageError", "shard"]
