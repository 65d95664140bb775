import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packing import Packer


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in g:
            assert np.array_equal(np.asarray(g[k]), np.asarray(e[k])), k


def check_resume_every_step(make, run, source):
    """Resumes from the state after every batch, both ways, and compares with the uninterrupted run.

    ``make()`` builds a fresh stage, ``run(stage, documents)`` returns its batch iterator and
    ``source`` is the list of documents. Restarted source: the full list again (the stage skips
    what it consumed); positioned source: the list after ``consumed``.
    """
    stage = make()
    states = [copy.deepcopy(stage.state_dict())]
    full = []
    for batch in run(stage, source):
        full.append(batch)
        states.append(pickle.loads(pickle.dumps(stage.state_dict())))
    final_stats = stage.stats()
    for k, state in enumerate(states):
        restarted = make()
        restarted.load_state_dict(state)
        assert_same_batches(list(run(restarted, source)), full[k:])
        assert restarted.stats() == final_stats
        consumed = state.get("documents_consumed", state.get("sequences_consumed"))
        positioned = make()
        positioned.load_state_dict(state, skip_consumed=False)
        assert_same_batches(list(run(positioned, iter(source[consumed:]))), full[k:])
    return full


def make_docs(lengths, offset=1):
    """Documents whose tokens are all distinct (so every token can be traced)."""
    out, start = [], offset
    for n in lengths:
        out.append(np.arange(start, start + n))
        start += n
    return out


def segments(batch):
    """Real (non-padding) document segments of a packed batch, as token lists."""
    out = []
    for ids, doc in zip(batch["input_ids"], batch["document_ids"]):
        for d in range(doc.max() + 1):
            out.append(ids[doc == d].tolist())
    return out


def check_batch_invariants(batch, seq_len):
    ids, labels, pos, doc = (batch[k] for k in ("input_ids", "labels", "position_ids", "document_ids"))
    assert ids.shape[1] == seq_len
    for r in range(ids.shape[0]):
        real = doc[r] >= 0
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any()  # documents first, then padding
        assert (labels[r][~real] == -100).all()
        for d in range(doc[r].max() + 1):
            where = np.flatnonzero(doc[r] == d)
            assert np.array_equal(where, np.arange(where[0], where[0] + where.size))  # contiguous
            assert pos[r][where].tolist() == list(range(where.size))
            assert labels[r][where[0]] == -100
            assert np.array_equal(labels[r][where[1:]], ids[r][where[1:]])
    assert batch["cu_seqlens"][-1] == ids.size


lengths_st = st.lists(st.integers(0, 40), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(4, 24), st.integers(1, 12), st.integers(1, 4),
       st.sampled_from(["bfd", "ffd", "spfhp"]))
def test_every_token_exactly_once_and_fitting_docs_whole(lengths, seq_len, buffer_size, batch_size, algorithm):
    docs = make_docs(lengths)
    packer = Packer(seq_len, buffer_size=buffer_size, algorithm=algorithm)
    batches = list(packer.batches(docs, batch_size))
    assert all(len(b["input_ids"]) == batch_size for b in batches[:-1])
    segs = [s for b in batches for s in segments(b)]
    for b in batches:
        check_batch_invariants(b, seq_len)
    tokens = sorted(t for s in segs for t in s)
    assert tokens == sorted(t for d in docs for t in d.tolist())
    whole = {tuple(s) for s in segs}
    for d in docs:
        if 0 < len(d) <= seq_len:
            assert tuple(d.tolist()) in whole
        elif len(d) > seq_len:  # split into pieces of seq_len plus a remainder, in order
            pieces = [s for s in segs if s[0] in set(d.tolist())]
            assert sorted(sum(pieces, [])) == d.tolist()
            assert sorted(len(p) for p in pieces if len(p) < seq_len) == ([len(d) % seq_len] if len(d) % seq_len else [])
    s = packer.stats()
    assert s["documents_in"] == len(docs)
    assert s["tokens_out"] == sum(lengths)
    assert s["tokens_out"] + s["padding_tokens"] == s["rows_out"] * seq_len
    assert s["rows_out"] == sum(len(b["input_ids"]) for b in batches)


@settings(max_examples=25, deadline=None)
@given(lengths_st, st.integers(4, 24), st.integers(1, 8), st.integers(1, 3))
def test_resume_is_exact_at_every_step(lengths, seq_len, buffer_size, batch_size):
    docs = make_docs(lengths)
    check_resume_every_step(lambda: Packer(seq_len, buffer_size=buffer_size, eos_id=0),
                            lambda p, d: p.batches(d, batch_size), docs)


def test_resume_with_many_rounds_and_held_back_rows():
    rng = np.random.default_rng(3)
    docs = make_docs(rng.integers(1, 60, 150))
    full = check_resume_every_step(lambda: Packer(64, buffer_size=16, bos_id=0),
                                   lambda p, d: p.batches(d, 4), docs)
    assert len(full) > 10


def test_efficiency_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.5, 1.0, 6000).astype(int), 1, None)
    docs = (np.zeros(n, dtype=np.int32) for n in lengths)
    packer = Packer(4096, buffer_size=1000)
    for _ in packer.batches(docs, 8):
        pass
    s = packer.stats()
    assert s["tokens_out"] == lengths.sum()
    assert s["efficiency"] >= 0.99


def test_bos_eos_and_truncate():
    packer = Packer(6, buffer_size=4, bos_id=100, eos_id=101, overflow="truncate")
    batches = list(packer.batches([[1, 2], [3, 4, 5, 6, 7, 8]], 2))
    segs = sorted(s for b in batches for s in segments(b))
    assert segs == [[100, 1, 2, 101], [100, 3, 4, 5, 6, 7]]
    assert packer.stats()["tokens_truncated"] == 2  # 8 and the eos


def test_overflow_error_names_the_document():
    packer = Packer(4, overflow="error")
    with pytest.raises(ValueError, match="document 1 has 5 tokens"):
        list(packer.batches([[1], [1, 2, 3, 4, 5]], 1))


def test_bad_documents_and_arguments():
    with pytest.raises(ValueError, match="1-D"):
        list(Packer(8).batches([np.zeros((2, 2), dtype=int)], 1))
    with pytest.raises(ValueError, match="integer"):
        list(Packer(8).batches([np.zeros(3)], 1))
    for kwargs in ({"seq_len": 0}, {"seq_len": 8, "buffer_size": 0}, {"seq_len": 8, "overflow": "x"},
                   {"seq_len": 8, "algorithm": "x"}, {"seq_len": 8, "eos_id": 1.5}):
        with pytest.raises(ValueError):
            Packer(**kwargs)
    with pytest.raises(ValueError, match="batch_size"):
        Packer(8).batches([], 0)


def test_state_from_a_longer_source_is_an_error():
    packer = Packer(8, buffer_size=2)
    it = packer.batches(make_docs([3] * 10), 1)
    next(it)
    state = packer.state_dict()
    fresh = Packer(8, buffer_size=2)
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match="restart the same source"):
        list(fresh.batches(make_docs([3]), 1))
    with pytest.raises(ValueError, match="seq_len"):
        Packer(16).load_state_dict(state)


def test_batches_without_loaded_state_starts_afresh():
    docs = make_docs([5, 3, 7, 2, 6])
    packer = Packer(8, buffer_size=2)
    first = list(packer.batches(docs, 2))
    assert_same_batches(list(packer.batches(docs, 2)), first)
    assert packer.stats()["documents_in"] == len(docs)
