"""datapipe.read.rawbytes: uninitialised bytes and where their data lies."""
import ctypes

from datapipe.read import rawbytes


def test_a_new_bytes_filled_at_its_data_address_reads_back():
    value = rawbytes.new_bytes(None, 5)
    assert type(value) is bytes and len(value) == 5
    ctypes.memmove(rawbytes.data_address(value), b"hello", 5)
    assert value == b"hello" and hash(value) == hash(b"hello")
    other = b"another value"
    assert ctypes.string_at(rawbytes.data_address(other), len(other)) == other
