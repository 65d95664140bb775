import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packing import TokenBudgetBatcher
from tests.packing.test_packer import check_resume_every_step, make_docs


def rows_of(batch):
    return [ids[mask == 1].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=60), st.integers(8, 200), st.integers(1, 20),
       st.sampled_from([1, 4, 8]), st.one_of(st.none(), st.integers(1, 6)))
def test_budget_multiples_and_every_sequence_once(lengths, max_tokens, buffer_size, multiple, max_bs):
    seqs = make_docs(lengths)
    batcher = TokenBudgetBatcher(max_tokens, buffer_size=buffer_size, max_batch_size=max_bs,
                                 pad_to_multiple_of=multiple, too_long="truncate")
    batches = list(batcher.batches(seqs))
    max_len = max_tokens // multiple * multiple
    got = []
    for b in batches:
        bs, length = b["input_ids"].shape
        assert bs * length <= max_tokens
        assert length % multiple == 0
        assert max_bs is None or bs <= max_bs
        mask = b["attention_mask"]
        assert set(np.unique(mask)) <= {0, 1}
        # right padding, padded to this batch's own maximum
        n = mask.sum(1)
        assert all(mask[r, :n[r]].all() for r in range(bs))
        assert length == max(multiple, -(-n.max() // multiple) * multiple)
        assert (b["labels"][mask == 0] == -100).all()
        assert np.array_equal(b["labels"][mask == 1], b["input_ids"][mask == 1])
        assert (b["input_ids"][mask == 0] == 0).all()
        got += rows_of(b)
    expected = [s.tolist()[:max_len] for s in seqs]
    assert sorted(got) == sorted(expected)
    s = batcher.stats()
    assert s["tokens_out"] == sum(len(e) for e in expected)
    assert s["tokens_truncated"] == sum(lengths) - s["tokens_out"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=40), st.integers(32, 120), st.integers(1, 10))
def test_resume_is_exact_at_every_step(lengths, max_tokens, buffer_size):
    seqs = make_docs(lengths)
    check_resume_every_step(
        lambda: TokenBudgetBatcher(max_tokens, buffer_size=buffer_size, seed=7),
        lambda b, s: b.batches(s), seqs)


def test_seeded_shuffle_of_batches():
    seqs = make_docs(np.random.default_rng(0).integers(1, 100, 400))

    def order(seed):
        return [tuple(b["input_ids"][0, :3]) for b in
                TokenBudgetBatcher(512, buffer_size=400, seed=seed).batches(seqs)]

    assert order(1) == order(1)
    assert order(1) != order(2)
    lengths = [int(b["attention_mask"].sum(1).max()) for b in
               TokenBudgetBatcher(512, buffer_size=400, seed=1).batches(seqs)]
    assert lengths != sorted(lengths)  # batches are not served in length order


def test_less_padding_than_fixed_size_batches():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.5, 0.8, 3000).astype(int), 1, 512)
    seqs = [np.ones(n, dtype=np.int64) for n in lengths]
    batcher = TokenBudgetBatcher(8192, buffer_size=1000)
    for _ in batcher.batches(seqs):
        pass
    fixed_pad = 0
    for i in range(0, len(lengths), 32):
        chunk = lengths[i:i + 32]
        fixed_pad += len(chunk) * chunk.max() - chunk.sum()
    fixed_fraction = fixed_pad / (fixed_pad + lengths.sum())
    assert batcher.stats()["padding_fraction"] < fixed_fraction / 4


def test_too_long_and_bad_arguments():
    with pytest.raises(ValueError, match="too_long='truncate'"):
        list(TokenBudgetBatcher(16, buffer_size=4).batches([np.arange(17)]))
    with pytest.raises(ValueError, match="integer"):
        list(TokenBudgetBatcher(16, buffer_size=4).batches([np.zeros(3)]))
    for args, kwargs in (((0,), {"buffer_size": 4}), ((16,), {"buffer_size": 0}),
                         ((16,), {"buffer_size": 4, "pad_to_multiple_of": 32}),
                         ((16,), {"buffer_size": 4, "too_long": "drop"}),
                         ((16,), {"buffer_size": 4, "max_batch_size": 0})):
        with pytest.raises(ValueError):
            TokenBudgetBatcher(*args, **kwargs)
