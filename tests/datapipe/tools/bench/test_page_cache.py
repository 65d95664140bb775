import os

from datapipe.tools.bench.page_cache import drop_page_cache, resident_fraction


def test_page_cache_drop_is_verified(shard_dir):
    path = os.path.join(shard_dir, "shard-000000.tar")
    open(path, "rb").read()
    before = resident_fraction(path)
    res = drop_page_cache([path])
    if res["dropped"]:
        assert res["resident_after"] is None or res["resident_after"] < 0.05
        assert before is None or before > res["resident_after"]
    else:
        assert res["reason"]
