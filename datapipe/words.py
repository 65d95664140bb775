"""Counted nouns in messages: "1 shard", "2 shards" (never "1 shards")."""
from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"<n> <noun>"`` with the noun in the plural unless ``n`` is 1 (``plural``: for irregular nouns).

    ``counted(1, "shard")`` is ``"1 shard"``, ``counted(3, "shard")`` ``"3 shards"``,
    ``counted(2, "entry", "entries")`` ``"2 entries"``.
    """
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """The noun alone, as :func:`counted` would write it after ``n``."""
    return noun if n == 1 else (plural_form or noun + "s")
