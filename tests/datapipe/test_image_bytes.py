import io
import struct

import numpy as np
from PIL import Image

from datapipe.image_bytes import image_format, truncation


def _encoded(fmt, size=(64, 48)):
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def test_whole_images_pass_and_cut_ones_are_named():
    jpeg, png = _encoded("JPEG"), _encoded("PNG")
    assert truncation(jpeg) is None and truncation(png) is None
    assert truncation(jpeg + b"\x00" * 100) is None and truncation(png + b"trailer") is None  # bytes after the end
    assert truncation(memoryview(jpeg)) is None
    for cut in (30, len(jpeg) // 2, len(jpeg) - 1):
        assert truncation(jpeg[:cut]) == "truncated JPEG (no end-of-image marker)"
    assert truncation(png[: len(png) // 2]) == "truncated PNG (no IEND chunk)"
    assert truncation(b"GIF89a....") is None and truncation(b"") is None  # other formats: not this check's


def test_a_thumbnails_end_marker_does_not_hide_a_cut_main_image():
    thumb, main = _encoded("JPEG", (16, 12)), _encoded("JPEG", (200, 150))
    payload = b"Exif\x00\x00" + thumb  # an APP1 segment carrying a whole JPEG (with its own FFD9)
    with_thumb = main[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + main[2:]
    assert Image.open(io.BytesIO(with_thumb)).size == (200, 150) and truncation(with_thumb) is None
    assert truncation(with_thumb[: len(with_thumb) // 2]) == "truncated JPEG (no end-of-image marker)"


def test_a_webp_shorter_than_its_riff_header_counts_is_named():
    for webp in (_encoded("WEBP"), _encoded("WEBP", (300, 200))):
        assert truncation(webp) is None and truncation(webp + b"\0" * 9) is None
        for cut in (12, len(webp) // 2, len(webp) - 1):
            assert truncation(webp[:cut]) == f"truncated WebP ({cut} of the {len(webp)} bytes its header counts)"


def test_image_format_names_every_type_the_shard_job_writes():
    for fmt, name in (("JPEG", "jpeg"), ("PNG", "png"), ("WEBP", "webp"), ("BMP", "bmp"), ("TIFF", "tiff"),
                      ("GIF", "gif"), ("PPM", "pnm")):
        assert image_format(_encoded(fmt)) == name
        assert image_format(memoryview(_encoded(fmt))) == name
    assert image_format(b"plain text, not an image") is None and image_format(b"RIFF") is None
    assert image_format(b"RIFF\x10\0\0\0WAVEfmt ") is None  # RIFF, but not WebP
