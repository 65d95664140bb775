import numpy as np
import pytest

from datapipe import DataError
from datapipe.errors import ErrorPolicy
from loaders.images.encoded import EncodedBatches, handle_bad, iter_raw_batches, image_problem, parse_ascii_ints


def _encoded(fmt: str) -> bytes:
    """A small real image (the checks walk its header)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (20, 120, 220)).save(buf, format=fmt)
    return buf.getvalue()


def test_parse_ascii_ints_fast_path_and_its_refusals():
    rows = np.array([[b"1"[0], b"2"[0], b"3"[0]], [b"7"[0], 0, 0], [b"0"[0], 0, 0]], dtype=np.uint8)
    assert parse_ascii_ints(rows) == [123, 7, 0]
    for bad in ([b"1"[0], 10, 0], [0, b"1"[0], 0], [b"-"[0], b"1"[0], 0], [0, 0, 0]):  # newline, gap, sign, empty
        assert parse_ascii_ints(np.array([bad], dtype=np.uint8)) is None


def test_raw_batches_skip_and_count_what_is_not_an_image():
    jpeg = _encoded("JPEG")
    samples = [{"__key__": str(i), "__url__": "u", "jpg": jpeg, "cls": str(i).encode()} for i in range(5)]
    samples[2] = {**samples[2], "jpg": b"text, not an image......"}
    stats = {"skipped": 0, "last_errors": []}
    batches = list(iter_raw_batches(iter(samples), batch_size=2, drop_last=False, image_exts=("jpg",), label_key="cls",
                                    label_decoder=lambda b: int(b), on_error="skip", stats=stats))
    assert [b.labels for b in batches] == [[0, 1], [3, 4]]
    assert stats["skipped"] == 1 and "not an image" in stats["last_errors"][0]



def test_image_problem_names_empty_foreign_and_truncated_entries():
    jpeg, png = _encoded("JPEG"), _encoded("PNG")
    assert image_problem(jpeg) is None and image_problem(png) is None
    assert image_problem(jpeg + b"\0" * 8) is None and image_problem(png + b"trailer") is None  # bytes after the end
    assert image_problem(memoryview(jpeg)) is None  # zero-copy entries
    assert image_problem(b"") == "empty file"
    assert "signature" in image_problem(b"short") and "signature" in image_problem(b"plain text, not an image")
    assert image_problem(jpeg[:30]) == "truncated JPEG (no end-of-image marker)"
    assert image_problem(png[:30]) == "truncated PNG (no IEND chunk)"


def test_image_problem_names_a_damaged_header_between_a_right_signature_and_end():
    rng = np.random.default_rng(0)
    for _ in range(200):  # garbage between SOI and EOI: what crashed DALI's CPU decoder
        garbage = b"\xff\xd8\xff" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes() + b"\xff\xd9"
        assert image_problem(garbage).startswith("damaged JPEG header")
    assert image_problem(b"\xff\xd8\xff\xe0" + bytes(200) + b"\xff\xd9").startswith("damaged JPEG header")
    png = _encoded("PNG")
    assert image_problem(png[:8] + bytes(25) + png[33:]).startswith("damaged PNG header")


def _samples():
    jpeg = _encoded("JPEG")
    samples = [{"__key__": str(i), "__url__": "u", "jpg": jpeg, "cls": str(i).encode()} for i in range(5)]
    samples[1] = {**samples[1], "cls": b"one"}
    samples[3] = {k: v for k, v in samples[3].items() if k != "jpg"}
    return samples


def _labels(on_error, **kw):
    return [b.labels for b in iter_raw_batches(iter(_samples()), batch_size=2, drop_last=False, image_exts=("jpg",),
                                               label_key="cls", label_decoder=lambda b: int(b), on_error=on_error,
                                               **kw)]


def test_bad_samples_counted_by_the_policy_or_a_callable():
    policy = ErrorPolicy("skip")
    assert _labels(policy) == [[0, 2], [4]]
    assert policy.skipped == 2
    assert "cannot decode label" in policy.last_errors[0] and "no image" in policy.last_errors[1]
    seen, stats = [], {"skipped": 0, "last_errors": []}
    assert _labels(seen.append, stats=stats) == [[0, 2], [4]]  # a callable that returns: skip
    assert [e.key for e in seen] == ["1", "3"] and stats["skipped"] == 2 and len(stats["last_errors"]) == 2
    with pytest.raises(DataError, match="cannot decode label"):
        _labels(ErrorPolicy("raise"))
    with pytest.raises(DataError, match="cannot decode label"):
        _labels("raise", stats={"skipped": 0, "last_errors": []})
    with pytest.raises(TypeError, match="ErrorPolicy"):
        handle_bad(DataError("x"), "skip")


class _Stream:
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)

    def stats(self):
        return {"skipped": 1}  # one sample the stream itself lost


def test_encoded_batches_report_new_skips_with_each_batch():
    ds = EncodedBatches(_Stream(_samples()), batch_size=2, drop_last=False, image_exts=("jpg",), label_key="cls",
                        label_decoder=lambda b: int(b), on_error="skip")
    out = list(ds)
    assert [b["labels"].tolist() for b in out] == [[0, 2], [4]]
    assert [b["skipped"] for b in out] == [1, 1]  # label 1, then image 3 (the stream counts its own loss: its ledger)
    assert [len(b["errors"]) for b in out] == [1, 1]
    assert "cannot decode label" in out[0]["errors"][0] and "no image" in out[1]["errors"][0]


def test_gifs_are_reencoded_as_png_and_other_images_pass_as_they_are():
    import io

    from PIL import Image

    from loaders.images.encoded import dali_readable

    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (200, 10, 30)).save(buf, format="GIF")
    png = dali_readable(buf.getvalue())
    assert png.startswith(b"\x89PNG") and Image.open(io.BytesIO(png)).convert("RGB").getpixel((2, 2)) == (200, 10, 30)
    jpeg = _encoded("JPEG")
    assert dali_readable(jpeg) is jpeg
    with pytest.raises(ValueError, match="cannot read the GIF"):
        dali_readable(buf.getvalue()[:14])
    gif = {"__key__": "g", "__url__": "u", "gif": buf.getvalue(), "cls": b"3"}
    (batch,) = iter_raw_batches(iter([gif]), batch_size=2, drop_last=False, image_exts=("jpg", "gif"),
                                label_key="cls", label_decoder=int, on_error="raise", stats=None)
    assert bytes(batch.arrays[0][:4]) == b"\x89PNG" and batch.labels == [3]
