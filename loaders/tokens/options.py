"""``TokenLoader``'s rarer options in two frozen groups: how documents are read, and how they are batched.

``TokenLoader(source, *, seq_len, batch_size, ..., documents=DocumentOptions(...), packing=PackOptions(...))``.
Each group checks its own values when it is made (``ValueError`` naming the option).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import numpy as np

from packing.algorithms import ALGORITHMS
from packing.packer import OVERFLOW

BATCHING = ("packed", "dynamic")


def _token_id(name: str, value, *, none: bool) -> None:
    if none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name}={value!r}: pass a token id (an int >= 0)" + (" or None" if none else ""))


@dataclass(frozen=True)
class PackOptions:
    """How documents become batches.

    Args:
        batching: ``"packed"`` (default: documents packed into dense rows of ``seq_len`` with
            ``packing.Packer``; a batch is the packed-batch format of ``packing.batch``) or
            ``"dynamic"`` (``packing.TokenBudgetBatcher``: right-padded batches of at most
            ``max_tokens`` tokens).
        buffer_size: documents held while choosing rows (or batches).
        algorithm: the bin-packing algorithm (``"bfd"``, ``"ffd"``, ``"spfhp"``).
        overflow: a document longer than ``seq_len``: ``"split"`` into pieces, ``"truncate"``, or ``"error"``.
        eos_id: a token appended to every document before packing (``None``, the default, appends
            nothing: ``datapipe shard --tokenizer`` adds no EOS either, so give your tokenizer's EOS id
            here if the model should see document ends).
        bos_id: a token put before every document (``None``: none).
        pad_id: the id of padding positions.
        max_tokens: ``"dynamic"``: tokens per batch (default ``seq_len * batch_size``).
        pad_to_multiple_of: ``"dynamic"``: the padded length's multiple.
    """

    batching: str = "packed"
    buffer_size: int = 2048
    algorithm: str = "bfd"
    overflow: str = "split"
    eos_id: int | None = None
    bos_id: int | None = None
    pad_id: int = 0
    max_tokens: int | None = None
    pad_to_multiple_of: int = 8

    def __post_init__(self):
        if self.batching not in BATCHING:
            raise ValueError(f"batching={self.batching!r}: use one of {BATCHING}")
        for name in ("buffer_size", "pad_to_multiple_of", "max_tokens"):
            value = getattr(self, name)
            if name == "max_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"{name}={value!r}: pass an int >= 1")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: use one of {', '.join(ALGORITHMS)}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow={self.overflow!r}: use one of {', '.join(OVERFLOW)}")
        _token_id("eos_id", self.eos_id, none=True)
        _token_id("bos_id", self.bos_id, none=True)
        _token_id("pad_id", self.pad_id, none=False)


@dataclass(frozen=True)
class DocumentOptions:
    """Where a sample's tokens are.

    Args:
        token_key: the entry holding token ids: ``"npy"`` (default, a 1-D integer ``.npy`` array, as
            ``datapipe shard --tokenizer`` writes) or another entry of raw ints of ``token_dtype``.
        token_dtype: the dtype of raw token entries (not ``"npy"``).
        text_key: the text entry, tokenised with the loader's ``tokenizer`` when a sample has no
            ``token_key`` entry.
    """

    token_key: str = "npy"
    token_dtype: str = "int32"
    text_key: str = "txt"

    def __post_init__(self):
        for name in ("token_key", "text_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r}: pass the name of a sample entry")
        try:
            dtype = np.dtype(self.token_dtype)
        except TypeError:
            raise ValueError(f"token_dtype={self.token_dtype!r}: pass an integer dtype such as 'int32'") from None
        if dtype.kind not in "iu":
            raise ValueError(f"token_dtype={self.token_dtype!r}: pass an integer dtype such as 'int32'")
