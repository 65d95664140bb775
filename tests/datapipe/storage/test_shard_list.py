"""A brace range's URLs and names made as arrays read like the f-strings they stand for."""
import pytest

from datapipe.storage import shard_list
from datapipe.storage.shard_list import NumberedUrls, numbered_names


@pytest.mark.parametrize("head, lo, hi, width, tail", [
    ("data/shard-", 0, 12, 0, ".tar"),  # unpadded, across a digit count
    ("data/shard-", 7, 12345, 3, ".tar"),  # padded, then wider than the padding
    ("dä/", 998, 1003, 4, "ü.tar"),  # not ASCII
    ("", 0, 0, 0, ""),
    ("x", 99, 100, 2, "?a=1"),
])
def test_numbered_names_are_the_f_strings(head, lo, hi, width, tail, monkeypatch):
    want = [f"{head}{i:0{width}d}{tail}" for i in range(lo, hi + 1)]
    assert numbered_names(head, lo, hi, width, tail) == "\n".join(want)
    monkeypatch.setattr(shard_list, "_BLOCK", 5)  # URLs made in many blocks
    urls = NumberedUrls(head, lo, hi, width, tail)
    assert list(urls) == want and len(urls) == len(want) and urls[-1] == want[-1]


def test_a_newline_in_the_pattern_is_kept():
    assert list(NumberedUrls("a\nb-", 8, 10, 0, ".tar")) == ["a\nb-8.tar", "a\nb-9.tar", "a\nb-10.tar"]


def test_names_in_one_folder():
    assert NumberedUrls("s3://b/d/s-", 1, 3, 2, ".tar").in_folder() == ("s3://b/d", "s-01.tar\ns-02.tar\ns-03.tar")
    assert NumberedUrls("d/s-", 1, 3, 2, "/x.tar").in_folder() is None
