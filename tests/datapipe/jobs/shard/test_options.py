import dataclasses

import pytest

from datapipe.jobs.shard.options import ImageOptions, ShardOptions, TextOptions, UsageError, check_run, image_check


def test_shard_options_name_the_wrong_option():
    ShardOptions()
    for change, word in ((dict(kind="video"), "--input-kind"), (dict(max_count=0), "--max-count"),
                         (dict(max_bytes=-1), "--max-bytes"), (dict(pattern="a/b-%d.tar"), "--pattern"),
                         (dict(pattern="shard.tar"), "placeholder"), (dict(partition_size=0), "--partition-size"),
                         (dict(partition_bytes=0), "--partition-bytes"), (dict(seed="1"), "--seed"),
                         (dict(images={"resize": 3}), "ImageOptions"), (dict(text=None), "TextOptions")):
        with pytest.raises(UsageError, match=word):
            ShardOptions(**change)
    for make, word in ((lambda: ImageOptions(quality=101), "--quality"), (lambda: ImageOptions(resize=0), "--resize"),
                       (lambda: ImageOptions(check="full"), "--check-images"),
                       (lambda: TextOptions(tokenizer="gpt2"), "--tokenizer")):
        with pytest.raises(UsageError, match=word):
            make()
    for change, word in ((dict(engine="spark", workers=1), "--engine"), (dict(engine="local", workers=0), "--workers")):
        with pytest.raises(UsageError, match=word):
            check_run(**change)


def test_shard_options_are_frozen_and_normalised():
    o = ShardOptions(images=ImageOptions(check=True))
    assert o.images.check == "decode" and ImageOptions(check=False).check == "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.max_count = 3


def test_image_check_values():
    assert image_check(True) == "decode" and image_check(False) == "none" and image_check("open") == "open"
    with pytest.raises(UsageError, match="--check-images"):
        image_check("full")
    assert issubclass(UsageError, ValueError)
