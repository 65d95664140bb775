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


# JPEG start-of-frame markers (C4 DHT, C8 JPG and CC DAC are not frames); lossless ones need no DQT,
# arithmetic-coded ones no DHT, and a baseline frame may use the standard Huffman tables (motion JPEG)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})
_NO_DHT_NEEDED = frozenset({0xC0, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}  # color type -> depths
_BMP_HEADERS = (12, 16, 40, 52, 56, 64, 108, 124)


def _jpeg_header(d) -> str | None:
    """The marker segments from SOI to the first SOS: lengths, a frame, tables and the scan header."""
    n, pos = len(d), 2
    frame = dqt = dht = None
    while True:
        if pos + 4 > n or d[pos] != 0xFF:
            return "damaged JPEG header (no marker where one belongs)"
        marker = d[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xD8 or marker == 0xD9 or marker == 0x01 or 0xD0 <= marker <= 0xD7 or marker == 0x00:
            return f"damaged JPEG header (marker FF{marker:02X} before the first scan)"
        length = d[pos + 2] << 8 | d[pos + 3]
        if length < 2 or pos + 2 + length > n:
            return f"damaged JPEG header (segment FF{marker:02X} of length {length} at byte {pos})"
        body = pos + 4
        if marker in _SOF:
            comps = d[body + 5] if length >= 8 else 0
            if length < 8 or length != 8 + 3 * comps or not 1 <= comps <= 4:
                return "damaged JPEG header (frame header length or component count)"
            if not (d[body + 1] | d[body + 2]) or not (d[body + 3] | d[body + 4]):
                return "damaged JPEG header (zero image height or width)"
            frame = marker
        elif marker == 0xDB:
            dqt = True
        elif marker == 0xC4:
            dht = True
        elif marker == 0xDA:
            comps = d[body] if length >= 3 else 0
            if frame is None:
                return "damaged JPEG header (a scan before any frame header)"
            if length != 6 + 2 * comps or not 1 <= comps <= 4:
                return "damaged JPEG header (scan header length or component count)"
            if dqt is None and frame not in _LOSSLESS:
                return "damaged JPEG header (no quantisation table)"
            if dht is None and frame not in _NO_DHT_NEEDED:
                return "damaged JPEG header (no Huffman table)"
            return None
        pos += 2 + length


def _png_header(d) -> str | None:
    """The IHDR chunk right after the signature: length 13, a nonzero size, a valid depth / color type, its CRC."""
    import zlib

    if len(d) < 33 or bytes(d[8:16]) != b"\0\0\0\x0dIHDR":
        return "damaged PNG header (no IHDR chunk of length 13 after the signature)"
    ihdr = bytes(d[16:29])
    if ihdr[0:4] == b"\0\0\0\0" or ihdr[4:8] == b"\0\0\0\0" or ihdr[0] & 0x80 or ihdr[4] & 0x80:
        return "damaged PNG header (zero or oversized width or height)"
    if ihdr[8] not in _PNG_DEPTHS.get(ihdr[9], ()) or ihdr[10] or ihdr[11] or ihdr[12] > 1:
        return "damaged PNG header (invalid bit depth, color type, compression, filter or interlace)"
    if zlib.crc32(bytes(d[12:29])) != int.from_bytes(d[29:33], "big"):
        return "damaged PNG header (IHDR checksum mismatch)"
    return None


def _webp_header(d) -> str | None:
    """The first chunk after RIFF/WEBP: VP8 (key frame start code, nonzero size), VP8L (signature) or VP8X."""
    if len(d) < 30:
        return "damaged WebP header (too short for its first chunk)"
    kind, size = bytes(d[12:16]), int.from_bytes(d[16:20], "little")
    if 20 + size > len(d):
        return f"damaged WebP header (first chunk of {size} bytes runs past the file)"
    if kind == b"VP8 ":
        if size < 10 or bytes(d[23:26]) != b"\x9d\x01\x2a" or d[20] & 1:
            return "damaged WebP header (VP8 chunk without a key frame)"
        if not int.from_bytes(d[26:28], "little") & 0x3FFF or not int.from_bytes(d[28:30], "little") & 0x3FFF:
            return "damaged WebP header (zero width or height)"
        return None
    if kind == b"VP8L":
        return None if size >= 5 and d[20] == 0x2F else "damaged WebP header (VP8L chunk without its signature)"
    if kind == b"VP8X":
        return None if size >= 10 else "damaged WebP header (VP8X chunk shorter than 10 bytes)"
    return f"damaged WebP header (first chunk {kind!r} is not VP8, VP8L or VP8X)"


def _bmp_header(d) -> str | None:
    """The file and info headers: a known info header size, nonzero size, one plane, a known bit count."""
    if len(d) < 26:
        return "damaged BMP header (too short)"
    info, offset = int.from_bytes(d[14:18], "little"), int.from_bytes(d[10:14], "little")
    if info not in _BMP_HEADERS or len(d) < 14 + info or not 14 + info <= offset < len(d):
        return "damaged BMP header (info header size or pixel data offset)"
    if info == 12:
        w, h, planes, bits = (int.from_bytes(d[i:i + 2], "little") for i in (18, 20, 22, 24))
    else:
        w, h = (int.from_bytes(d[i:i + 4], "little", signed=True) for i in (18, 22))
        planes, bits = (int.from_bytes(d[i:i + 2], "little") for i in (26, 28))
    if w <= 0 or h == 0 or planes != 1 or bits not in (1, 4, 8, 16, 24, 32):
        return "damaged BMP header (width, height, planes or bit count)"
    return None


def _tiff_header(d) -> str | None:
    """The first image file directory: inside the file, with entries, among them a nonzero width and length."""
    order = "little" if d[0] == 0x49 else "big"
    n = len(d)
    ifd = int.from_bytes(d[4:8], order)
    count = int.from_bytes(d[ifd:ifd + 2], order) if 8 <= ifd <= n - 2 else 0
    if not count or ifd + 2 + 12 * count > n:
        return "damaged TIFF header (first directory outside the file or empty)"
    size = {}
    for e in range(ifd + 2, ifd + 2 + 12 * count, 12):
        tag = int.from_bytes(d[e:e + 2], order)
        if tag in (256, 257):  # ImageWidth, ImageLength: SHORT (3) or LONG (4), one value held in the entry
            short = int.from_bytes(d[e + 2:e + 4], order) == 3
            size[tag] = int.from_bytes(d[e + 8:e + 10] if short else d[e + 8:e + 12], order)
    if not size.get(256) or not size.get(257):
        return "damaged TIFF header (no nonzero image width and length)"
    return None


def _pnm_header(d) -> str | None:
    """The ASCII header after P1..P6: width, height (and maxval but for P1 / P4), comments allowed."""
    kind = d[1] - 0x30
    want = 2 if kind in (1, 4) else 3
    tokens, text = [], bytes(d[2:512])
    for line in text.split(b"\n"):
        tokens += line.split(b"#", 1)[0].split()
        if len(tokens) >= want:
            break
    if len(tokens) < want or not all(t.isdigit() for t in tokens[:want]):
        return "damaged PNM header (no width, height and maxval)"
    values = [int(t) for t in tokens[:want]]
    if not values[0] or not values[1] or (want == 3 and not 1 <= values[2] <= 65535):
        return "damaged PNM header (zero width or height, or maxval outside 1..65535)"
    return None


_HEADERS = {"jpeg": _jpeg_header, "png": _png_header, "webp": _webp_header, "bmp": _bmp_header,
            "tiff": _tiff_header, "pnm": _pnm_header}


def header_problem(data, *, fmt: str | None = None) -> str | None:
    """What is wrong with an image's header, by its signature's format, or None (sound, or a format not checked).

    A walk over the header only, in a few microseconds, no decode: for JPEG the marker segments from
    SOI to the first SOS (valid lengths, a frame header with nonzero height, width and 1-4
    components, a quantisation table, a Huffman table unless a baseline frame uses the standard
    ones, the scan header); for PNG the IHDR chunk (length 13, nonzero size, a valid bit depth and
    color type, its CRC); for WebP the first chunk; for BMP, TIFF and PNM the size fields. GIF and
    JPEG 2000 are not checked. ``data``: bytes or a memoryview; ``fmt``: its :func:`image_format`, if known.
    """
    fmt = fmt or image_format(data)
    check = _HEADERS.get(fmt)
    return None if check is None else check(data if isinstance(data, memoryview) else memoryview(data))
