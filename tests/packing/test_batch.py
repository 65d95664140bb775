import numpy as np
import pytest
import torch

from packing.batch import (attention_mask_for_sdpa, flash_attn_varlen_kwargs, packed_batch,
                           to_torch)


def example():
    rows = [[np.array([5, 6, 7]), np.array([8, 9])], [np.array([1, 2, 3, 4])]]
    return packed_batch(rows, 6, pad_id=0)


def test_fields_of_a_small_batch():
    b = example()
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 2, 3, 4, -100, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    assert b["cu_seqlens"].dtype == np.int32
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 6, 10, 12]
    assert b["max_seqlen"] == 4
    assert b["input_ids"].dtype == np.int64


def test_full_row_has_no_padding_segment():
    b = packed_batch([[np.arange(4)]], 4)
    assert b["cu_seqlens"].tolist() == [0, 4]
    assert (b["document_ids"] == 0).all()


def test_overfull_row_is_rejected():
    with pytest.raises(ValueError, match="seq_len"):
        packed_batch([[np.arange(5)]], 4)


def test_cu_seqlens_agree_with_position_ids():
    rng = np.random.default_rng(1)
    rows = [[rng.integers(0, 50, n) for n in (3, 1, 7)], [rng.integers(0, 50, 12)], []]
    b = packed_batch(rows, 12)
    flat_pos = b["position_ids"].reshape(-1)
    starts = np.flatnonzero(flat_pos == 0)
    assert starts.tolist() == b["cu_seqlens"][:-1].tolist()
    assert b["cu_seqlens"][-1] == b["input_ids"].size
    assert b["max_seqlen"] == np.diff(b["cu_seqlens"]).max()


def test_sdpa_mask_is_block_diagonal_causal():
    b = example()
    m = attention_mask_for_sdpa(b["document_ids"])
    assert m.shape == (2, 1, 6, 6) and m.dtype == bool
    row0 = m[0, 0]
    assert row0[4].tolist() == [False, False, False, True, True, False]  # doc 1 sees only doc 1
    assert row0[2].tolist() == [True, True, True, False, False, False]
    assert not row0[0, 1]  # causal
    assert m.any(axis=-1).all()  # no query row fully masked (padding sees padding)
    t = attention_mask_for_sdpa(torch.from_numpy(b["document_ids"]))
    assert isinstance(t, torch.Tensor) and torch.equal(t, torch.from_numpy(m))


def test_torch_conversion_and_varlen_kwargs():
    b = to_torch(example())
    assert b["input_ids"].dtype == torch.int64 and b["cu_seqlens"].dtype == torch.int32
    assert isinstance(b["max_seqlen"], int)
    kw = flash_attn_varlen_kwargs(b)
    assert set(kw) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    assert torch.equal(kw["cu_seqlens_q"], b["cu_seqlens"]) and kw["max_seqlen_k"] == 4
