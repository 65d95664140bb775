"""rank_world: the one rank / world-size lookup."""
import types

from datapipe import ShardStream, mix
from datapipe.order.ranks import rank_world


def test_own_settings_then_holders_then_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_world() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_world() == (2, 4)
    (tmp_path / "s.tar").write_bytes(b"")
    unset, own = ShardStream(str(tmp_path / "s.tar")), ShardStream(str(tmp_path / "s.tar"), rank=1, world_size=3)
    assert rank_world(unset) == (2, 4) and rank_world(own) == (1, 3) and own._rank_world() == (1, 3)
    assert rank_world(types.SimpleNamespace(stream=own)) == (1, 3)  # a loader holding a stream
    assert rank_world(types.SimpleNamespace(dataset=types.SimpleNamespace(stream=own))) == (1, 3)
    assert rank_world(mix([unset, own], weights=[1, 1])) == (1, 3)  # the first stream that sets them
    assert rank_world(mix([unset], weights=[1])) == (2, 4)
