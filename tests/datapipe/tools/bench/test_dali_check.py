"""What the DALI baseline's input check refuses: images DALI's decoder cannot take, counted with the first one."""
import io

import pytest
from PIL import Image

from datapipe import ShardWriter
from datapipe.tools.bench.dali_check import PipelineRefused, check_dali_input, dali_problem


def _jpeg():
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, format="JPEG")
    return out.getvalue()


def test_dali_problem_names_what_the_decoder_cannot_take():
    good = _jpeg()
    assert dali_problem({"jpg": good}) is None
    assert dali_problem({"gif": b"GIF89a..."}) == "gif"
    assert dali_problem({"jpg": b""}) == "empty file"
    assert "truncated JPEG" in dali_problem({"jpg": good[: len(good) // 2]})
    assert "not an image" in dali_problem({"png": b"hello, world, not a png"})
    # a JPEG signature and end marker around no header: DALI's CPU decoder crashed on it in a batch of 64
    # (ImageLoader's own header check, loaders.images.encoded.image_problem, names it now)
    assert "damaged JPEG header" in dali_problem({"jpg": b"\xff\xd8\xff\xe0" + bytes(200) + b"\xff\xd9"})


def test_check_counts_within_its_limit_and_names_the_first(tmp_path):
    good = _jpeg()
    with ShardWriter(str(tmp_path / "shard-%06d.tar"), max_count=100) as w:
        for i in range(10):
            w.write({"__key__": f"k{i}", "jpg": b"" if i in (6, 8) else good, "cls": b"1"})
    urls = sorted(str(p) for p in tmp_path.glob("*.tar"))
    assert check_dali_input(urls, limit=6) == 6  # the bad ones lie past what it would read
    with pytest.raises(PipelineRefused) as e:
        check_dali_input(urls, limit=100)
    assert e.value.fields == {"refused_samples": 2, "checked_samples": 10, "refused_reasons": {"empty file": 2}}
    assert "2 of the 10 samples" in str(e.value) and "'k6'" in str(e.value)
