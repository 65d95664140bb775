"""datapipe.jobs.shard."""
