import pytest

from tests.shards import write_shards


@pytest.fixture
def shard_dir(tmp_path):
    """Three small shards (110 samples) in a folder."""
    write_shards(tmp_path / "data", [40, 40, 30])
    return str(tmp_path / "data")
