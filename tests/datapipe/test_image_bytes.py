import io
import struct

import numpy as np
from PIL import Image

from datapipe.image_bytes import header_problem, image_format, truncation


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


def test_sound_headers_pass_in_every_format_the_shard_job_writes():
    for fmt in ("JPEG", "PNG", "WEBP", "BMP", "TIFF", "PPM"):
        for mode in ("RGB", "L"):
            buf = io.BytesIO()
            Image.new(mode, (64, 48), 90).save(buf, format=fmt)
            assert header_problem(buf.getvalue()) is None, (fmt, mode)
            assert header_problem(memoryview(buf.getvalue())) is None
    for options in ({"progressive": True}, {"exif": b"Exif\0\0" + bytes(3000)}, {"quality": 100, "subsampling": 0}):
        buf = io.BytesIO()
        Image.new("RGB", (64, 48)).save(buf, format="JPEG", **options)
        assert header_problem(buf.getvalue()) is None, options
    buf = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buf, format="WEBP", lossless=True)
    assert header_problem(buf.getvalue()) is None
    assert header_problem(b"GIF89a" + bytes(20)) is None  # not checked here (re-encoded before DALI)


def _jpeg_segments(jpeg):
    """(marker, start, length) of a JPEG's segments from SOI to SOS."""
    out, pos = [], 2
    while jpeg[pos + 1] != 0xDA:
        length = struct.unpack(">H", jpeg[pos + 2:pos + 4])[0]
        out.append((jpeg[pos + 1], pos, length))
        pos += 2 + length
    return out


def test_damaged_jpeg_headers_are_named():
    jpeg = _encoded("JPEG")
    segments = _jpeg_segments(jpeg)
    sof = next(s for s in segments if s[0] == 0xC0)
    zero_height = jpeg[:sof[1] + 5] + b"\0\0" + jpeg[sof[1] + 7:]
    long_segment = jpeg[:4] + b"\xff\xf0" + jpeg[6:]
    scan = jpeg[segments[-1][1] + 2 + segments[-1][2]:]
    no_dqt = jpeg[:2] + b"".join(jpeg[s:s + 2 + n] for m, s, n in segments if m != 0xDB) + scan
    for damaged in (zero_height, long_segment, no_dqt, b"\xff\xd8\xff\xe0\0\0" + bytes(50) + b"\xff\xd9",
                    b"\xff\xd8\xff\xda\0\x08\x01\x01\0\0\x3f\0" + bytes(50) + b"\xff\xd9"):
        assert header_problem(damaged).startswith("damaged JPEG header"), damaged[:40]
    rest = b"".join(jpeg[s:s + 2 + n] for m, s, n in segments if m != 0xC4)  # no DHT: fine for baseline only
    assert header_problem(jpeg[:2] + rest + scan) is None
    progressive = jpeg[:2] + rest.replace(b"\xff\xc0", b"\xff\xc2") + scan
    assert header_problem(progressive) == "damaged JPEG header (no Huffman table)"


def test_damaged_png_webp_bmp_tiff_pnm_headers_are_named():
    png = _encoded("PNG")
    bad_depth = png[:24] + b"\x03" + png[25:]  # RGB at 3 bits: no such PNG
    bad_crc = png[:29] + bytes(4) + png[33:]
    zero_width = png[:16] + bytes(4) + png[20:]
    for damaged in (bad_depth, bad_crc, zero_width, png[:8] + bytes(40)):
        assert header_problem(damaged).startswith("damaged PNG header")
    webp = _encoded("WEBP")
    assert header_problem(webp[:12] + b"JUNK" + webp[16:]).startswith("damaged WebP header")
    assert header_problem(webp[:12] + webp[12:16] + b"\xff\xff\xff\x00" + webp[20:]).startswith("damaged WebP header")
    bmp = _encoded("BMP")
    assert header_problem(bmp[:14] + b"\x07\0\0\0" + bmp[18:]).startswith("damaged BMP header")
    assert header_problem(bmp[:18] + bytes(4) + bmp[22:]).startswith("damaged BMP header")
    tiff = _encoded("TIFF")
    assert header_problem(tiff[:4] + b"\xff\xff\xff\x00" + tiff[8:]).startswith("damaged TIFF header")
    for pnm in (b"P6\n0 48\n255\n" + bytes(30), b"P6 # comment\nxx yy\n255\n", b"P5\n4 4\n0\n" + bytes(16)):
        assert header_problem(pnm).startswith("damaged PNM header"), pnm
    assert header_problem(b"P6\n# made by hand\n2 1\n255\n" + bytes(6)) is None
