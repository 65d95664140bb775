import numpy as np

from loaders.images.encoded import iter_raw_batches, looks_like_image, parse_ascii_ints


def test_parse_ascii_ints_fast_path_and_its_refusals():
    rows = np.array([[b"1"[0], b"2"[0], b"3"[0]], [b"7"[0], 0, 0], [b"0"[0], 0, 0]], dtype=np.uint8)
    assert parse_ascii_ints(rows) == [123, 7, 0]
    for bad in ([b"1"[0], 10, 0], [0, b"1"[0], 0], [b"-"[0], b"1"[0], 0], [0, 0, 0]):  # newline, gap, sign, empty
        assert parse_ascii_ints(np.array([bad], dtype=np.uint8)) is None


def test_raw_batches_skip_and_count_what_is_not_an_image():
    jpeg = b"\xff\xd8\xff" + b"\0" * 20
    samples = [{"__key__": str(i), "__url__": "u", "jpg": jpeg, "cls": str(i).encode()} for i in range(5)]
    samples[2] = {**samples[2], "jpg": b"text, not an image......"}
    stats = {"skipped": 0, "last_errors": []}
    batches = list(iter_raw_batches(iter(samples), batch_size=2, drop_last=False, image_exts=("jpg",), label_key="cls",
                                    label_decoder=lambda b: int(b), on_error="skip", stats=stats))
    assert [b.labels for b in batches] == [[0, 1], [3, 4]]
    assert stats["skipped"] == 1 and "not an image" in stats["last_errors"][0]
    assert looks_like_image(jpeg) and not looks_like_image(b"short")
