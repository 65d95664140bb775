import random
import tarfile

from datapipe.tar.headers import _checksum_ok


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
