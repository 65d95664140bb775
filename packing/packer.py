"""Online packing of an unbounded document stream into fixed-length rows.

``Packer`` keeps a bounded buffer of documents. When it needs rows it tops the buffer up to
``buffer_size`` documents, bin-packs the whole buffer (``pack_lengths``), emits the well-filled
rows and keeps the documents of the few under-filled rows back to mix with fresh documents in
the next round (at most half a buffer, and no document more than ``_MAX_ROUNDS`` rounds). At the
end of the stream everything is emitted. A document that fits in a row is never split.

Documents longer than ``seq_len`` (after ``bos_id`` / ``eos_id`` are added), by ``overflow``:

- ``"split"``: cut into pieces of ``seq_len`` tokens plus a remainder; every piece is packed as
  a document of its own (its positions restart at 0, its first label is -100), so positions
  never exceed ``seq_len - 1`` and attention never spans rows.
- ``"truncate"``: keep the first ``seq_len`` tokens (the rest is counted in ``stats()``).
- ``"error"``: ``ValueError`` naming the document.

Resuming: ``state_dict()`` (taken between batches) records how many documents were read from
the source and the tokens of the documents still buffered or in rows not yet emitted. After
``load_state_dict(state)``, the next ``batches(documents, batch_size)`` skips the first
``documents_consumed`` documents of ``documents`` (the caller restarted its source from the
beginning) and yields exactly the batches that would have followed; pass
``skip_consumed=False`` to ``load_state_dict`` when the caller's source is already positioned
after them (e.g. a resumed stream). Without a loaded state, ``batches`` starts afresh.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

import numpy as np

from packing.algorithms import ALGORITHMS, pack_lengths
from packing.batch import packed_batch

OVERFLOW = ("split", "truncate", "error")
_MIN_FILL = 0.995  # rows filled less than this may be held back for the next round
_MAX_ROUNDS = 4  # a document is held back at most this many rounds
_STAT_KEYS = ("documents_in", "empty_documents", "tokens_in", "tokens_truncated", "pieces",
              "rows_out", "tokens_out", "padding_tokens", "batches_out")


class _State:
    def __init__(self):
        self.consumed = 0  # documents read from the source
        self.seen = 0  # pieces created so far (arrival order of buffered pieces)
        self.buffer: list[tuple[np.ndarray, int, int]] = []  # (tokens, arrival, rounds held)
        self.ready: deque[list[np.ndarray]] = deque()  # rows decided but not yet emitted
        self.stats = dict.fromkeys(_STAT_KEYS, 0)


def _as_document(doc, index: int) -> np.ndarray:
    arr = np.asarray(doc)
    if arr.ndim != 1:
        raise ValueError(f"document {index} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"document {index} must hold integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def skip_consumed(source: Iterable, skip: int, what: str) -> Iterator:
    """An iterator over ``source`` past its first ``skip`` items (those a loaded state already consumed)."""
    it = iter(source)
    for i in range(skip):
        if next(it, None) is None:
            raise ValueError(f"the {what[:-1]} source ended after {i} {what}, but the loaded "
                             f"state consumed {skip}; restart the same source from the beginning")
    return it


def pack_rows(documents: Iterable, state: _State, *, seq_len: int, buffer_size: int,
              overflow: str, bos_id: int | None, eos_id: int | None, algorithm: str,
              skip: int) -> Iterator[list[np.ndarray]]:
    """Yields rows (lists of token arrays); ``state`` is up to date whenever a row is yielded."""
    it = skip_consumed(documents, skip, "documents")
    stats = state.stats
    exhausted = False
    while True:
        if state.ready:
            row = state.ready.popleft()
            used = sum(len(p) for p in row)
            stats["rows_out"] += 1
            stats["tokens_out"] += used
            stats["padding_tokens"] += seq_len - used
            yield row
            continue
        while not exhausted and len(state.buffer) < buffer_size:
            doc = next(it, None)
            if doc is None:
                exhausted = True
                break
            index = state.consumed
            state.consumed += 1
            _admit(_as_document(doc, index), index, state, seq_len, overflow, bos_id, eos_id)
        if not state.buffer:
            return
        _round(state, seq_len, buffer_size, algorithm, final=exhausted)


def _admit(doc, index, state, seq_len, overflow, bos_id, eos_id) -> None:
    stats = state.stats
    stats["documents_in"] += 1
    stats["tokens_in"] += doc.size
    if bos_id is not None or eos_id is not None:
        doc = np.concatenate([[bos_id] if bos_id is not None else [], doc,
                              [eos_id] if eos_id is not None else []]).astype(np.int64)
    if doc.size == 0:
        stats["empty_documents"] += 1
        return
    if doc.size > seq_len:
        if overflow == "error":
            raise ValueError(f"document {index} has {doc.size} tokens > seq_len {seq_len}; "
                             "use overflow='split' or 'truncate'")
        if overflow == "truncate":
            stats["tokens_truncated"] += doc.size - seq_len
            doc = doc[:seq_len]
    for start in range(0, doc.size, seq_len):
        state.buffer.append((doc[start:start + seq_len], state.seen, 0))
        state.seen += 1
        stats["pieces"] += 1


def _round(state: _State, seq_len: int, buffer_size: int, algorithm: str, final: bool) -> None:
    """Packs the buffer; moves well-filled rows to ``ready``, keeps the rest buffered."""
    buf = state.buffer
    lens = [len(p[0]) for p in buf]
    bins = pack_lengths(lens, seq_len, algorithm=algorithm)
    hold = set()
    if not final:
        limit = buffer_size // 2
        fills = [sum(lens[i] for i in b) for b in bins]
        candidates = sorted((f, k) for k, (f, b) in enumerate(zip(fills, bins))
                            if f < _MIN_FILL * seq_len and max(buf[i][2] for i in b) < _MAX_ROUNDS)
        held = 0
        for _, k in candidates:
            if held + len(bins[k]) > limit:
                break
            hold.add(k)
            held += len(bins[k])
    rows = [sorted(b) for k, b in enumerate(bins) if k not in hold]  # buffer is in arrival order
    rows.sort(key=lambda r: r[0])
    state.ready.extend([buf[i][0] for i in r] for r in rows)
    kept = sorted(i for k in hold for i in bins[k])
    state.buffer = [(buf[i][0], buf[i][1], buf[i][2] + 1) for i in kept]


class Packer:
    """Packs a stream of token documents into dense rows of ``seq_len`` (see the module doc)."""

    def __init__(self, seq_len: int, *, buffer_size: int = 2048, overflow: str = "split",
                 eos_id: int | None = None, bos_id: int | None = None, pad_id: int = 0,
                 algorithm: str = "bfd"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size <= 0:
            raise ValueError(f"buffer_size must be a positive int (documents), got {buffer_size!r}")
        if overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        for name, value in (("eos_id", eos_id), ("bos_id", bos_id), ("pad_id", pad_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ValueError(f"{name} must be an int token id or None, got {value!r}")
        self.seq_len = int(seq_len)
        self.buffer_size = int(buffer_size)
        self.overflow = overflow
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.pad_id = int(pad_id)
        self.algorithm = algorithm
        self._state = _State()
        self._skip = 0
        self._loaded = False

    def rows(self, documents: Iterable) -> Iterator[list[np.ndarray]]:
        """Yields rows as lists of token arrays (the documents of the row, in arrival order)."""
        if not self._loaded:
            self._state = _State()
            self._skip = 0
        self._loaded = False
        skip, self._skip = self._skip, 0
        return pack_rows(documents, self._state, seq_len=self.seq_len,
                         buffer_size=self.buffer_size, overflow=self.overflow, bos_id=self.bos_id,
                         eos_id=self.eos_id, algorithm=self.algorithm, skip=skip)

    def batches(self, documents: Iterable, batch_size: int) -> Iterator[dict]:
        """Yields packed batches of ``batch_size`` rows (the last may hold fewer); see ``packing.batch``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        return self._batches(self.rows(documents), int(batch_size))

    def _batches(self, rows: Iterator, batch_size: int) -> Iterator[dict]:
        pending = []
        for row in rows:
            pending.append(row)
            if len(pending) == batch_size:
                self._state.stats["batches_out"] += 1
                yield packed_batch(pending, self.seq_len, pad_id=self.pad_id)
                pending = []
        if pending:
            self._state.stats["batches_out"] += 1
            yield packed_batch(pending, self.seq_len, pad_id=self.pad_id)

    def stats(self) -> dict:
        """Counters so far plus ``efficiency`` = real tokens / row capacity of the rows emitted."""
        s = dict(self._state.stats)
        capacity = s["rows_out"] * self.seq_len
        s["efficiency"] = s["tokens_out"] / capacity if capacity else 0.0
        s["padding_fraction"] = s["padding_tokens"] / capacity if capacity else 0.0
        return s

    def snapshot(self) -> _State:
        """A cheap copy of the current state (no token copies) for ``state_dict(snapshot)`` later.

        A loader that prefetches takes one per batch, then turns the one of the last batch it
        handed out into a state dict only when a checkpoint is asked for.
        """
        st, snap = self._state, _State()
        snap.consumed, snap.seen = st.consumed, st.seen
        snap.buffer = list(st.buffer)
        snap.ready = deque(st.ready)
        snap.stats = dict(st.stats)
        return snap

    def state_dict(self, snapshot: _State | None = None) -> dict:
        """The resume point after the last batch yielded, or at ``snapshot`` (see the module doc)."""
        st = self._state if snapshot is None else snapshot
        buf = [p[0] for p in st.buffer]
        ready = [p for row in st.ready for p in row]
        return {
            "kind": "Packer",
            "seq_len": self.seq_len,
            "documents_consumed": st.consumed,
            "pieces_seen": st.seen,
            "buffer": {
                "tokens": _concat(buf),
                "lengths": np.array([len(p) for p in buf], dtype=np.int64),
                "arrival": np.array([p[1] for p in st.buffer], dtype=np.int64),
                "rounds_held": np.array([p[2] for p in st.buffer], dtype=np.int64),
            },
            "ready": {
                "tokens": _concat(ready),
                "lengths": np.array([len(p) for p in ready], dtype=np.int64),
                "row_sizes": np.array([len(row) for row in st.ready], dtype=np.int64),
            },
            "stats": dict(st.stats),
        }

    def load_state_dict(self, state: dict, *, skip_consumed: bool = True) -> None:
        """Restores ``state``; the next ``batches`` call resumes from it.

        ``skip_consumed=True``: that call skips the ``documents_consumed`` documents its source
        yields first (the source was restarted from the beginning); ``False``: the source is
        already positioned after them.
        """
        if isinstance(state, dict) and state.get("kind", "Packer") != "Packer":
            raise ValueError(f"this is a {state['kind']} state, not a Packer state: load it into a {state['kind']}")
        try:
            if int(state["seq_len"]) != self.seq_len:
                raise ValueError(f"state is for seq_len {state['seq_len']}, this Packer has {self.seq_len}")
            st = _State()
            st.consumed = int(state["documents_consumed"])
            st.seen = int(state["pieces_seen"])
            b = state["buffer"]
            pieces = _split(b["tokens"], b["lengths"])
            st.buffer = [(p, int(a), int(h)) for p, a, h in zip(pieces, b["arrival"], b["rounds_held"])]
            r = state["ready"]
            pieces = _split(r["tokens"], r["lengths"])
            offsets = np.concatenate([[0], np.cumsum(np.asarray(r["row_sizes"], dtype=np.int64))])
            st.ready = deque(pieces[int(a):int(e)] for a, e in zip(offsets[:-1], offsets[1:]))
            st.stats = {k: int(state["stats"][k]) for k in _STAT_KEYS}
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a Packer state_dict: {e!r}") from e
        self._state = st
        self._skip = st.consumed if skip_consumed else 0
        self._loaded = True


def held_pieces(state: dict) -> list[np.ndarray]:
    """The token pieces a Packer state holds (buffered, then in rows not yet emitted), in that order."""
    try:
        return (_split(state["buffer"]["tokens"], state["buffer"]["lengths"])
                + _split(state["ready"]["tokens"], state["ready"]["lengths"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a Packer state_dict: {e!r}") from e


def holding_state(seq_len: int, pieces: list[np.ndarray]) -> dict:
    """A fresh Packer state whose buffer holds ``pieces`` (for handing buffered documents to another packer).

    Load it with ``skip_consumed=False``: the pieces are packed with the next documents read.
    """
    st = _State()
    st.buffer = [(np.asarray(p, dtype=np.int64), i, 0) for i, p in enumerate(pieces)]
    st.seen = len(pieces)
    return Packer(seq_len).state_dict(st)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)


def _split(tokens, lengths) -> list[np.ndarray]:
    tokens = np.asarray(tokens, dtype=np.int64)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    return [tokens[e - n:e].copy() for e, n in zip(ends.tolist(), np.asarray(lengths).tolist())]
