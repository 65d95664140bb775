import json

from hypothesis import given, settings, strategies as st

from datapipe.jobs.shard.readers import iter_partition
from datapipe.jobs.shard.sources import open_source


@settings(max_examples=25, deadline=None)
@given(lines=st.lists(st.text(max_size=30), min_size=1, max_size=40), chunk=st.integers(1, 200))
def test_jsonl_byte_ranges_cover_every_line_once(tmp_path_factory, lines, chunk):
    path = tmp_path_factory.mktemp("j") / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    src = open_source(str(path), kind="text", partition_bytes=chunk)
    got = [r.sample["txt"] for p in src.partitions for r in iter_partition(p)]
    assert got == lines
