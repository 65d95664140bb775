"""The packed-batch format and helpers for attention over packed rows.

A packed batch is a dict of numpy arrays (``to_torch`` converts):

- ``input_ids`` [B, L] int64: documents laid end to end in each row, then ``pad_id`` padding.
- ``labels`` [B, L] int64: ``input_ids`` with -100 on padding and on the first token of every
  document (Hugging Face convention: the model shifts labels, so no token learns to predict
  across a document boundary).
- ``position_ids`` [B, L] int64: restart at 0 for every document. A row's padding tail counts
  as one more segment, so its positions also run 0, 1, 2, ...
- ``document_ids`` [B, L] int64: 0, 1, 2, ... for the documents of a row; -1 on padding.
- ``cu_seqlens`` [S + 1] int32: FlashAttention varlen layout over the flattened batch (B * L
  tokens): cumulative segment lengths, where the segments are the documents of every row in
  order and each row's padding tail is a segment of its own. ``cu_seqlens[-1] == B * L``, so
  ``input_ids.reshape(-1)`` can be fed to a varlen kernel as is; padding attends only to
  padding and its labels are -100, so it never reaches the loss.
- ``max_seqlen`` int: the longest segment (padding segments included).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

IGNORE_INDEX = -100


def packed_batch(rows: Sequence[Sequence[np.ndarray]], seq_len: int, *, pad_id: int = 0) -> dict:
    """Builds a packed batch from rows, each a list of 1-D token arrays of total length <= seq_len."""
    segs, seg_lens, seg_doc = [], [], []
    for r, row in enumerate(rows):
        used = 0
        for d, doc in enumerate(row):
            n = len(doc)
            if n == 0:
                continue
            segs.append(np.asarray(doc, dtype=np.int64))
            seg_lens.append(n)
            seg_doc.append(d)
            used += n
        if used > seq_len:
            raise ValueError(f"row {r} holds {used} tokens > seq_len {seq_len}")
        if used < seq_len:
            segs.append(np.full(seq_len - used, pad_id, dtype=np.int64))
            seg_lens.append(seq_len - used)
            seg_doc.append(-1)
    b = len(rows)
    if not segs:
        z = np.zeros((b, seq_len), dtype=np.int64)
        return {"input_ids": z, "labels": z.copy(), "position_ids": z.copy(),
                "document_ids": z.copy(), "cu_seqlens": np.zeros(1, dtype=np.int32),
                "max_seqlen": 0}
    seg_lens = np.asarray(seg_lens, dtype=np.int64)
    seg_doc = np.asarray(seg_doc, dtype=np.int64)
    starts = np.cumsum(seg_lens) - seg_lens
    input_ids = np.concatenate(segs)
    position_ids = np.arange(input_ids.size, dtype=np.int64) - np.repeat(starts, seg_lens)
    document_ids = np.repeat(seg_doc, seg_lens)
    labels = input_ids.copy()
    labels[document_ids < 0] = IGNORE_INDEX
    labels[starts[seg_doc >= 0]] = IGNORE_INDEX
    cu = np.zeros(seg_lens.size + 1, dtype=np.int32)
    np.cumsum(seg_lens, out=cu[1:])
    shape = (b, seq_len)
    return {
        "input_ids": input_ids.reshape(shape),
        "labels": labels.reshape(shape),
        "position_ids": position_ids.reshape(shape),
        "document_ids": document_ids.reshape(shape),
        "cu_seqlens": cu,
        "max_seqlen": int(seg_lens.max()),
    }


def to_torch(batch: dict, device=None) -> dict:
    """Converts the numpy arrays of a batch to torch tensors (optionally on ``device``)."""
    import torch

    out = {}
    for key, value in batch.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
            if device is not None:
                value = value.to(device)
        out[key] = value
    return out


def attention_mask_for_sdpa(document_ids):
    """Block-diagonal causal mask [B, 1, L, L] (True = may attend) for ``scaled_dot_product_attention``.

    Token i attends to token j <= i of the same document. Padding (-1) attends causally to the
    row's padding, so no query row is fully masked (which would give NaN). Takes and returns
    numpy arrays or torch tensors alike.
    """
    if isinstance(document_ids, np.ndarray):
        d = document_ids
        length = d.shape[-1]
        causal = np.tril(np.ones((length, length), dtype=bool))
        return ((d[:, :, None] == d[:, None, :]) & causal)[:, None]
    import torch

    d = document_ids
    length = d.shape[-1]
    causal = torch.ones((length, length), dtype=torch.bool, device=d.device).tril()
    return ((d[:, :, None] == d[:, None, :]) & causal).unsqueeze(1)


def flash_attn_varlen_kwargs(batch: dict) -> dict:
    """Keyword arguments for ``flash_attn_varlen_func`` over the flattened batch."""
    cu = batch["cu_seqlens"]
    return {"cu_seqlens_q": cu, "cu_seqlens_k": cu,
            "max_seqlen_q": int(batch["max_seqlen"]), "max_seqlen_k": int(batch["max_seqlen"])}


def hf_inputs(batch: dict, device=None) -> dict:
    """Keyword arguments for a Hugging Face causal LM trained exactly on a packed batch.

    ``model(**hf_inputs(batch))`` passes ``input_ids``, ``position_ids`` and ``labels`` as torch
    tensors, no ``attention_mask`` and ``use_cache=False``: transformers then detects the packed
    documents from the restarting ``position_ids`` and masks attention between them (its flash
    attention path derives the varlen layout from them too). With a cache, or with an
    ``attention_mask``, that detection is skipped and documents attend to each other.
    """
    missing = {"input_ids", "position_ids", "labels"} - set(batch)
    if missing:
        raise ValueError(f"batch lacks {sorted(missing)}: pass a packed batch (Packer / TokenLoader output)")
    out = to_torch({k: batch[k] for k in ("input_ids", "position_ids", "labels")})
    for key, value in out.items():
        if getattr(value, "device", None) is None:
            raise TypeError(f"batch[{key!r}] is a {type(value).__name__}: pass numpy arrays or torch tensors")
        if device is not None:
            out[key] = value.to(device)
    out["use_cache"] = False
    return out
