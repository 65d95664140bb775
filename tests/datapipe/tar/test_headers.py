import io
import random
import tarfile

import pytest

from datapipe.tar.blocks import BlockReader
from datapipe.tar.headers import TarFormatError, _checksum_ok, next_member


def header_block(name, data):
    """The 512-byte ustar header that tarfile writes for a member ``name`` holding ``data``."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(tarfile.USTAR_FORMAT)


def test_checksum_matches_tarfile_for_random_headers():
    rnd = random.Random(0)
    for _ in range(200):
        name = "".join(rnd.choice("abc./_") for _ in range(rnd.randrange(1, 90)))
        data = header_block(name + ".x", rnd.randbytes(rnd.randrange(0, 50)))
        assert _checksum_ok(data[:512])
        broken = bytearray(data[:512])
        broken[rnd.randrange(0, 148)] ^= 1 << rnd.randrange(8)
        assert not _checksum_ok(bytes(broken))


def _linked_tar(kind, fmt, name="k001.jpg", target="k000.jpg"):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        link = tarfile.TarInfo(name)
        link.type, link.linkname = kind, target
        tar.addfile(link)
        last = tarfile.TarInfo("k002.jpg")
        last.size = 3
        tar.addfile(last, io.BytesIO(b"two"))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("kind, words", [(tarfile.SYMTYPE, "a symbolic link"), (tarfile.LNKTYPE, "a hard link"),
                                         (tarfile.FIFOTYPE, "a FIFO")])
def test_next_member_refuses_data_less_members_named_like_sample_members(kind, words, fmt):
    long_name = "d/" + "x" * 120 + "/k001.jpg"  # a long name and a long target: GNU / pax extension headers
    long_target = "t/" + "y" * 120 + "/k000.jpg"
    data = _linked_tar(kind, fmt, long_name if fmt != tarfile.USTAR_FORMAT else "k001.jpg",
                       long_target if fmt != tarfile.USTAR_FORMAT else "k000.jpg")
    name = long_name if fmt != tarfile.USTAR_FORMAT else "k001.jpg"
    with pytest.raises(TarFormatError, match=f"is {words}") as info:
        next_member(BlockReader(io.BytesIO(data)))
    assert info.value.name == name and info.value.key == name[:-4] and info.value.intact
    if kind != tarfile.FIFOTYPE:
        target = long_target if fmt != tarfile.USTAR_FORMAT else "k000.jpg"
        assert f"to {target!r}" in str(info.value)
    seen = []
    reader = BlockReader(io.BytesIO(data))
    assert next_member(reader, resync=True, on_error=seen.append)[0] == "k002.jpg"  # the member after it
    assert [e.name for e in seen] == [name]


def test_next_member_skips_directories_and_links_no_sample_would_have():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind in (("d", tarfile.DIRTYPE), ("latest", tarfile.SYMTYPE), ("__meta__", tarfile.LNKTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "d/k000.bin"
            tar.addfile(info)
        info = tarfile.TarInfo("d/k000.bin")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"0"))
    assert next_member(BlockReader(io.BytesIO(buf.getvalue())))[0] == "d/k000.bin"
