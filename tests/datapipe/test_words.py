from datapipe.words import counted, plural


def test_counted_nouns_are_singular_for_one_only():
    assert counted(1, "shard") == "1 shard" and counted(0, "shard") == "0 shards" and counted(2, "shard") == "2 shards"
    assert counted(1, "entry", "entries") == "1 entry" and counted(5, "entry", "entries") == "5 entries"
    assert plural(1, "shard") == "shard" and plural(3, "shard") == "shards"
