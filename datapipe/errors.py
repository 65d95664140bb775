"""The one exception type for bad data and unreadable storage."""


class DataError(Exception):
    """Bad data or unreadable storage. ``url`` and ``key`` name where (credentials redacted)."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None):
        self.url = url
        self.key = key
        where = []
        if url is not None:
            where.append(f"shard {url}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
