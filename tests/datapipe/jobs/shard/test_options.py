import pytest

from datapipe.jobs.shard.options import UsageError, check_options, image_check

GOOD = dict(kind="auto", max_bytes=1 << 20, max_count=10, pattern="shard-%06d.tar", resize=None, quality=None,
            workers=1, engine="local", partition_size=None, partition_bytes=1 << 20, tokenizer=None)


def test_check_options_names_the_wrong_option():
    check_options(**GOOD)
    for change, word in ((dict(kind="video"), "--input-kind"), (dict(engine="spark"), "--engine"),
                         (dict(max_count=0), "--max-count"), (dict(pattern="a/b-%d.tar"), "--pattern"),
                         (dict(pattern="shard.tar"), "placeholder"), (dict(quality=101), "--quality"),
                         (dict(workers=0), "--workers"), (dict(tokenizer="gpt2"), "--tokenizer")):
        with pytest.raises(UsageError, match=word):
            check_options(**dict(GOOD, **change))


def test_image_check_values():
    assert image_check(True) == "decode" and image_check(False) == "none" and image_check("open") == "open"
    with pytest.raises(UsageError, match="--check-images"):
        image_check("full")
    assert issubclass(UsageError, ValueError)
