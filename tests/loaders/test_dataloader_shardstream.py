"""loaders.DataLoader over ShardStream: exact mid-epoch resume with workers, and epochs after it."""
import pytest

from datapipe import ShardStream
from loaders import DataLoader
from tests.shards import write_shards
from tests.resume import assert_resumes_identically


def keys(batch):
    return [s["__key__"] for s in batch]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_resume_with_workers_at_every_step(tmp_path, num_workers):
    urls, samples = write_shards(tmp_path / "d", [7, 2, 9, 4])

    def make():
        stream = ShardStream(urls, shuffle=True, shuffle_buffer=5, seed=3, rank=0, world_size=2)
        return DataLoader(stream, batch_size=2, num_workers=num_workers, collate_fn=keys)

    # every step without workers; a few (worker start-up is slow on CI's 2 cores) with them
    full = assert_resumes_identically(make, steps=None if num_workers == 0 else (1, 3, 5))
    flat = [k for b in full for k in b]
    assert len(flat) == 11 and len(set(flat)) == 11


def test_epochs_after_a_resume_start_afresh(tmp_path):
    urls, _ = write_shards(tmp_path / "d", [6, 6])

    def make():
        return DataLoader(ShardStream(urls, shuffle=True, shuffle_buffer=4), batch_size=2, num_workers=2,
                          collate_fn=keys)

    reference = make()
    epoch0 = list(reference)
    epoch1 = list(reference)
    assert epoch0 != epoch1  # the loader advances the epoch, and the stream reshuffles

    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + list(resumed) == epoch0
    assert list(resumed) == epoch1
