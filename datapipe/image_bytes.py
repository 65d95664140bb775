"""A cheap look at encoded image bytes: is a JPEG or PNG cut short? (No decode; used by the shard job's
image check and by ImageLoader before DALI.)"""
from __future__ import annotations

JPEG_START = b"\xff\xd8\xff"
PNG_START = b"\x89PNG\r\n\x1a\n"


def truncation(data) -> str | None:
    """Why a JPEG or PNG is cut short, or None (whole, or another format).

    A JPEG must have its end-of-image marker (FFD9) after its last scan (FFDA; neither can occur
    inside scan data, so an EXIF thumbnail's FFD9 does not count); a PNG must have its IEND chunk.
    Either may be followed by other bytes. ``data``: bytes or a memoryview.
    """
    head = bytes(data[:8])
    if head.startswith(JPEG_START):
        if bytes(data[-2:]) == b"\xff\xd9":
            return None
        raw = bytes(data)
        end = raw.rfind(b"\xff\xd9")
        return "truncated JPEG (no end-of-image marker)" if end < 0 or end < raw.rfind(b"\xff\xda") else None
    if head == PNG_START and bytes(data[-8:-4]) != b"IEND" and bytes(data).rfind(b"IEND\xaeB`\x82") < 0:
        return "truncated PNG (no IEND chunk)"
    return None
