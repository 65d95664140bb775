"""The error that says a shard job was asked for wrongly (exit status 2)."""


class UsageError(ValueError):
    """A mistake in how the job was asked for (exit status 2)."""
