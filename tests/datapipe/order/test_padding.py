"""Padding under DDP: a lost sample's place holds a repeat, and a resume from any state yields exactly the rest
of the uninterrupted run (the same repeats), also right before a lost sample and among the repeats owed for
samples lost before a worker's first one."""
import functools
import tarfile

import pytest

from datapipe import ShardStream
from datapipe.order.padding import deliver
from tests.datapipe.order.test_elastic import run_rank
from tests.datapipe.test_stream import _check_marks, _corrupt, keys
from tests.resume import assert_resumes_identically
from tests.shards import write_shards

# 10 samples: s0-00000..s0-00005, s1-00000..s1-00003; two ranks of 5 (rank 0: shard 0's first five unshuffled)
LOST = [
    ("s0-00002",),  # rank 0's third: a resume right after the second must repeat the second
    ("s0-00000", "s0-00001", "s0-00005", "s1-00000"),  # each rank's first two: repeats owed to its first sample
    ("s0-00004", "s1-00003"),  # the last of each rank
    ("s0-00001", "s0-00003", "s1-00001", "s1-00002"),
]
ORDERS = [(False, 0), (True, 0), (True, 4)]


def _fail_on(lost, sample):
    if sample["__key__"] in lost:
        raise ValueError("unreadable")
    return sample


@pytest.fixture
def urls(tmp_path):
    return write_shards(tmp_path / "s", [6, 4])[0]


def _stream(urls, rank, lost, *, shuffle=False, shuffle_buffer=0, world_size=2):
    stream = ShardStream(urls, on_error="skip", rank=rank, world_size=world_size, shuffle=shuffle,
                         shuffle_buffer=shuffle_buffer, seed=5)
    stream.set_epoch(1)
    return stream.map(functools.partial(_fail_on, frozenset(lost)))


@pytest.mark.parametrize("shuffle,shuffle_buffer", ORDERS)
@pytest.mark.parametrize("lost", LOST)
@pytest.mark.parametrize("rank", [0, 1])
def test_resume_from_every_state_repeats_what_the_uninterrupted_run_repeats(urls, rank, lost, shuffle,
                                                                            shuffle_buffer):
    make = functools.partial(_stream, urls, rank, lost, shuffle=shuffle, shuffle_buffer=shuffle_buffer)
    full = assert_resumes_identically(make)
    assert len(full) == 5 and not set(keys(full)) & set(lost)


def test_a_resume_right_before_a_lost_sample_repeats_the_one_before(urls):
    """The colleague's case: s0, s1, [s2 lost], s3, s4 is s0, s1, s1, s3, s4; resumed after s1: s1, s3, s4."""
    make = functools.partial(_stream, urls, 0, ("s0-00002",))
    assert keys(make()) == ["s0-00000", "s0-00001", "s0-00001", "s0-00003", "s0-00004"]
    stream = make()
    it = iter(stream)
    next(it), next(it)
    resumed = make()
    resumed.load_state_dict(stream.state_dict())
    assert keys(resumed) == ["s0-00001", "s0-00003", "s0-00004"]
    assert resumed.stats()["padded"] == 1 and resumed.stats()["samples"] == 2


def test_a_resume_among_the_repeats_owed_for_losses_before_the_first_sample(urls):
    make = functools.partial(_stream, urls, 0, ("s0-00000", "s0-00001"))
    assert keys(make()) == ["s0-00002"] * 3 + ["s0-00003", "s0-00004"]
    for k in range(4):
        stream = make()
        it = iter(stream)
        for _ in range(k):
            next(it)
        resumed = make()
        resumed.load_state_dict(stream.state_dict())
        assert keys(resumed) == (["s0-00002"] * 3 + ["s0-00003", "s0-00004"])[k:], f"resumed after {k}"


@pytest.mark.parametrize("shuffle,shuffle_buffer", ORDERS)
@pytest.mark.parametrize("lost", LOST)
def test_state_before_and_after_every_sample_resume_exactly(urls, lost, shuffle, shuffle_buffer):
    for rank in (0, 1):
        _check_marks(functools.partial(_stream, urls, rank, lost, shuffle=shuffle, shuffle_buffer=shuffle_buffer))


@pytest.mark.parametrize("lost", [LOST[0], LOST[3], ("s0-00000", "s0-00002", "s1-00001", "s1-00002")])
@pytest.mark.parametrize("shuffle,shuffle_buffer", [(False, 0), (True, 3)])
def test_resume_from_every_step_with_dataloader_workers(urls, lost, shuffle, shuffle_buffer):
    """torch's DataLoader with 2 workers: each worker pads on its own; the rank's state (its workers' positions, as
    a loader gathers them) resumes exactly after every item, also as the global state of both ranks."""
    make = functools.partial(_stream, urls, lost=lost, shuffle=shuffle, shuffle_buffer=shuffle_buffer)
    full = {rank: run_rank(make(rank), 2)[0] for rank in (0, 1)}
    assert [len(f) for f in full.values()] == [5, 5]
    for k in range(6):
        heads, states = {}, []
        for rank in (0, 1):
            heads[rank], state = run_rank(make(rank), 2, k)
            states.append(state)
        for rank in (0, 1):
            for saved in (states[rank], states):  # the rank's own state, and the global one
                rest, _ = run_rank(make(rank), 2, state=saved)
                assert heads[rank] + rest == full[rank], f"rank {rank} resumed after {k}"


@pytest.mark.parametrize("shuffle,shuffle_buffer", ORDERS)
def test_a_damaged_sample_resumes_exactly_and_is_counted_once(tmp_path, shuffle, shuffle_buffer):
    """A member the tar reader cannot read (not a failing map step): the repeat read again for a resume is read
    alone, so the damage beside it is not met (nor counted) twice."""
    urls, _ = write_shards(tmp_path / "d", [6, 4])
    with tarfile.open(urls[0]) as tar:
        member = tar.getmembers()[4]  # sample 2's first member: its header damaged
    _corrupt(urls[0], member.offset + 108, b"\xff" * 8)

    def make(rank):
        return ShardStream(urls, on_error="skip", rank=rank, world_size=2, shuffle=shuffle,
                           shuffle_buffer=shuffle_buffer, seed=5)

    whole = {rank: make(rank) for rank in (0, 1)}
    full = {rank: keys(stream) for rank, stream in whole.items()}
    for rank in (0, 1):
        assert len(full[rank]) == 5 and "s0-00002" not in full[rank]
        skipped, errors = [], []
        for k in range(6):
            stream = make(rank)
            it = iter(stream)
            head = [next(it)["__key__"] for _ in range(k)]
            resumed = make(rank)
            resumed.load_state_dict(stream.state_dict())
            assert head + keys(resumed) == full[rank], f"rank {rank} resumed after {k}"
            skipped.append(resumed.stats()["skipped"])
            errors.append(resumed.stats()["errors"])
        # met by the resumes that draw it, counted as the uninterrupted run counts it; never more
        assert max(skipped) <= whole[rank].stats()["skipped"] and max(errors) <= whole[rank].stats()["errors"]
        if rank == 0 and not shuffle:  # s0, s1, [s2 lost: s1], s3, s4
            assert skipped == [1, 1, 1, 0, 0, 0] and errors == [whole[rank].stats()["errors"]] * 3 + [0] * 3
    assert sum(stream.stats()["skipped"] for stream in whole.values()) == 1


def test_a_state_of_an_earlier_version_loads_as_before(urls):
    """A state without the repeat's draw (an earlier datapipe's) still loads: the count is right, and the repeat is
    the next sample, as that version resumed it."""
    make = functools.partial(_stream, urls, 0, ("s0-00002",))
    stream = make()
    it = iter(stream)
    next(it), next(it)
    state = stream.state_dict()
    state["workers"] = {w: {"draws": p["draws"], "done": p["done"]} for w, p in state["workers"].items()}
    resumed = make()
    resumed.load_state_dict(state)
    assert keys(resumed) == ["s0-00003", "s0-00003", "s0-00004"]


def test_a_lost_repeat_source_on_resume_is_owed_to_the_next_sample():
    """``deliver`` alone: a resumed pass whose sample to repeat cannot be read again hands the next one out twice
    (the count stays equal); one that can hands that sample out in the lost one's place."""
    lost = object()
    position, counts = {"draws": 2, "done": False, "last": 2}, {"samples": 0, "padded": 0}
    got = list(deliver(iter([lost, "c", "d"]), position, counts, lost=lost, pad=True, reread=lambda draw: None))
    assert got == ["c", "c", "d"] and counts == {"samples": 2, "padded": 1}
    position = {"draws": 2, "done": False, "last": 2}
    got = list(deliver(iter([lost, "c", "d"]), position, {"samples": 0, "padded": 0}, lost=lost, pad=True,
                       reread=lambda draw: f"again {draw}"))
    assert got == ["again 2", "c", "d"] and position == {"draws": 5, "done": False, "last": 5}


def test_a_state_with_a_malformed_repeat_entry_is_refused(urls):
    stream = _stream(urls, 0, ())
    it = iter(stream)
    next(it)
    state = stream.state_dict()
    state["workers"][0]["last"] = "two"
    with pytest.raises(ValueError, match="position"):
        _stream(urls, 0, ()).load_state_dict(state)
