"""jobs.shard."""
