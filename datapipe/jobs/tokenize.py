"""Tokenizers for ``datapipe shard --tokenizer``: a byte-level fallback and Hugging Face ``tokenizers`` JSON files.

``load_tokenizer("byte")`` needs nothing: token ids are the UTF-8 bytes (0..255), optionally
followed by an end-of-document id. ``load_tokenizer("path/tokenizer.json")`` loads a Hugging Face
tokenizer file with the optional ``tokenizers`` package (imported only then).
"""
from __future__ import annotations

import io

import numpy as np


class ByteTokenizer:
    """Token ids = the text's UTF-8 bytes; ``eos_id`` (e.g. 256) is appended when given."""

    def __init__(self, *, eos_id: int | None = None):
        self.eos_id = eos_id
        self.vocab_size = 256 if eos_id is None else max(256, eos_id + 1)
        self.name = "byte"

    def encode(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        if self.eos_id is not None:
            ids = np.append(ids, np.int32(self.eos_id))
        return ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < 256]
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file; ``encode`` returns int32 ids (special tokens as the file says)."""

    def __init__(self, path: str):
        from datapipe.extras import require

        Tokenizer = require("tokenizers", what=f"--tokenizer {path} (or use --tokenizer byte)").Tokenizer
        import fsspec

        with fsspec.open(path, "r") as f:
            text = f.read()
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own exception type
            raise ValueError(f"{path!r} is not a Hugging Face tokenizer JSON file: {e}") from e
        self.vocab_size = self._tok.get_vocab_size()
        self.name = path

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
    """``"byte"`` -> :class:`ByteTokenizer`; a ``.json`` path or URL -> :class:`HFTokenizer`."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte' or the path of a tokenizer.json file")


def npy_bytes(ids: np.ndarray) -> bytes:
    """``np.save`` bytes of a 1-D int32 array (what a shard's ``.npy`` entry holds)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(ids, dtype=np.int32), allow_pickle=False)
    return buf.getvalue()
