"""A cheap look at encoded image bytes: which entries hold images, what format a file's signature says, and
whether a JPEG, PNG or WebP is cut short. (No decode; used by ``.decode()``, by the shard job's image check
and by ImageLoader before DALI.)"""
from __future__ import annotations

# The entries that hold an image, in the order a sample's image is looked for: every extension `datapipe shard`
# writes (jpg, png, webp, bmp, gif, tiff, ppm) and their usual spellings. ImageLoader reads them all by default.
IMAGE_ENTRIES = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm", "pbm", "pnm")

JPEG_START = b"\xff\xd8\xff"
PNG_START = b"\x89PNG\r\n\x1a\n"
GIF_STARTS = (b"GIF87a", b"GIF89a")
_SIGNATURES = {JPEG_START: "jpeg", PNG_START: "png", b"BM": "bmp", b"II*\x00": "tiff", b"MM\x00*": "tiff",
               GIF_STARTS[0]: "gif", GIF_STARTS[1]: "gif", b"\x00\x00\x00\x0cjP  ": "jpeg2000",
               b"\xff\x4f\xff\x51": "jpeg2000", **{b"P%d" % i: "pnm" for i in range(1, 7)}}


def image_format(data) -> str | None:
    """The format a file's signature names (``"jpeg"``, ``"png"``, ``"webp"``, ``"bmp"``, ``"tiff"``, ``"gif"``,
    ``"pnm"``, ``"jpeg2000"``), or None for anything else (text, garbage, too short)."""
    head = bytes(data[:16])  # data may be a zero-copy memoryview
    if len(head) < 12:
        return None
    if head.startswith(JPEG_START):
        return "jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((name for start, name in _SIGNATURES.items() if head.startswith(start)), None)


def truncation(data) -> str | None:
    """Why a JPEG, PNG or WebP is cut short, or None (whole, or another format).

    A JPEG must have its end-of-image marker (FFD9) after its last scan (FFDA; neither can occur
    inside scan data, so an EXIF thumbnail's FFD9 does not count); a PNG must have its IEND chunk; a
    WebP must hold the bytes its RIFF header counts. Either may be followed by other bytes.
    ``data``: bytes or a memoryview.
    """
    head = bytes(data[:12])
    if head.startswith(JPEG_START):
        if bytes(data[-2:]) == b"\xff\xd9":
            return None
        raw = bytes(data)
        end = raw.rfind(b"\xff\xd9")
        return "truncated JPEG (no end-of-image marker)" if end < 0 or end < raw.rfind(b"\xff\xda") else None
    if head[:8] == PNG_START and bytes(data[-8:-4]) != b"IEND" and bytes(data).rfind(b"IEND\xaeB`\x82") < 0:
        return "truncated PNG (no IEND chunk)"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        need = 8 + int.from_bytes(head[4:8], "little")
        if len(data) < need:
            return f"truncated WebP ({len(data)} of the {need} bytes its header counts)"
    return None
