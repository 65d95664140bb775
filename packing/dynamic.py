"""Token-budget dynamic batching: length-bucketed, right-padded batches of at most ``max_tokens``.

For models that cannot isolate documents inside a row (e.g. encoders with plain padding masks).
The batcher reads ``buffer_size`` sequences, sorts them by length, cuts the sorted run greedily
into batches whose ``B x padded_L <= max_tokens`` (``padded_L`` = the batch's longest sequence
rounded up to ``pad_to_multiple_of``; at most ``max_batch_size`` rows), shuffles those batches
with a generator seeded by ``(seed, round)`` and yields them; then it reads the next buffer.

A sequence longer than the longest allowed row (``max_tokens`` rounded down to the multiple):
``too_long="error"`` raises ``ValueError``, ``"truncate"`` keeps its first tokens.

Resuming works as for ``Packer``: ``state_dict()`` records the sequences read and the batches of
the current round not yet yielded; after ``load_state_dict(state)`` the next ``batches`` call skips
``sequences_consumed`` sequences of its source (or none with ``skip_consumed=False``).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from packing.batch import IGNORE_INDEX
from packing.packer import skip_consumed

TOO_LONG = ("error", "truncate")
_STAT_KEYS = ("sequences_in", "tokens_in", "tokens_truncated", "batches_out", "rows_out",
              "tokens_out", "padding_tokens")


class _State:
    def __init__(self):
        self.consumed = 0
        self.round = 0
        self.ready: list[list[np.ndarray]] = []  # batches of the current round not yet yielded
        self.stats = dict.fromkeys(_STAT_KEYS, 0)


def _padded(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def plan_batches(lengths: list[int], *, max_tokens: int, max_batch_size: int | None,
                 multiple: int) -> list[list[int]]:
    """Greedy cut of the length-sorted indices into batches within the token budget."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    out, cur, cur_len = [], [], 0
    for i in order:
        new_len = max(cur_len, _padded(lengths[i], multiple))
        full = max_batch_size is not None and len(cur) >= max_batch_size
        if cur and (full or (len(cur) + 1) * new_len > max_tokens):
            out.append(cur)
            cur, new_len = [], _padded(lengths[i], multiple)
        cur.append(i)
        cur_len = new_len
    if cur:
        out.append(cur)
    return out


def budget_batches(sequences: Iterable, state: _State, *, max_tokens: int, buffer_size: int,
                   max_batch_size: int | None, multiple: int, seed: int, too_long: str,
                   skip: int) -> Iterator[list[np.ndarray]]:
    """Yields batches as lists of token arrays; ``state`` is current whenever one is yielded."""
    it = skip_consumed(sequences, skip, "sequences")
    max_len = max_tokens // multiple * multiple
    stats = state.stats
    exhausted = False
    while True:
        if state.ready:
            yield state.ready.pop(0)
            continue
        if exhausted:
            return
        buf = []
        while len(buf) < buffer_size:
            seq = next(it, None)
            if seq is None:
                exhausted = True
                break
            index = state.consumed
            state.consumed += 1
            arr = np.asarray(seq)
            if arr.ndim != 1:
                raise ValueError(f"sequence {index} must be 1-D, got shape {arr.shape}")
            arr = arr.astype(np.int64) if arr.size == 0 or arr.dtype.kind in "iu" else None
            if arr is None:
                raise ValueError(f"sequence {index} must hold integer token ids, got dtype "
                                 f"{np.asarray(seq).dtype}")
            stats["sequences_in"] += 1
            stats["tokens_in"] += arr.size
            if arr.size > max_len:
                if too_long == "error":
                    raise ValueError(
                        f"sequence {index} has {arr.size} tokens > {max_len} (max_tokens rounded "
                        f"down to pad_to_multiple_of); raise max_tokens or pass too_long='truncate'")
                stats["tokens_truncated"] += arr.size - max_len
                arr = arr[:max_len]
            buf.append(arr)
        if not buf:
            return
        plan = plan_batches([len(a) for a in buf], max_tokens=max_tokens,
                            max_batch_size=max_batch_size, multiple=multiple)
        perm = np.random.default_rng([seed, state.round]).permutation(len(plan))
        state.round += 1
        state.ready = [[buf[i] for i in plan[k]] for k in perm]


class TokenBudgetBatcher:
    """Dynamic batches of right-padded sequences with ``B x L <= max_tokens`` (see the module doc)."""

    def __init__(self, max_tokens: int, *, buffer_size: int, max_batch_size: int | None = None,
                 pad_to_multiple_of: int = 8, seed: int = 0, pad_id: int = 0,
                 too_long: str = "error"):
        def positive(name, v):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
            return int(v)

        self.max_tokens = positive("max_tokens", max_tokens)
        self.buffer_size = positive("buffer_size", buffer_size)
        self.max_batch_size = None if max_batch_size is None else positive("max_batch_size", max_batch_size)
        self.pad_to_multiple_of = positive("pad_to_multiple_of", pad_to_multiple_of)
        if self.pad_to_multiple_of > self.max_tokens:
            raise ValueError(f"pad_to_multiple_of ({pad_to_multiple_of}) must be <= max_tokens ({max_tokens})")
        if too_long not in TOO_LONG:
            raise ValueError(f"too_long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = int(seed)
        self.pad_id = int(pad_id)
        self.too_long = too_long
        self._state = _State()
        self._skip = 0
        self._loaded = False

    def batches(self, sequences: Iterable) -> Iterator[dict]:
        """Yields dicts ``input_ids`` / ``attention_mask`` / ``labels``, each [B, L] int64."""
        if not self._loaded:
            self._state = _State()
            self._skip = 0
        self._loaded = False
        skip, self._skip = self._skip, 0
        gen = budget_batches(sequences, self._state, max_tokens=self.max_tokens,
                             buffer_size=self.buffer_size, max_batch_size=self.max_batch_size,
                             multiple=self.pad_to_multiple_of, seed=self.seed,
                             too_long=self.too_long, skip=skip)
        return self._collate(gen)

    def _collate(self, gen) -> Iterator[dict]:
        stats = self._state.stats
        for seqs in gen:
            length = _padded(max(len(s) for s in seqs), self.pad_to_multiple_of)
            b = len(seqs)
            input_ids = np.full((b, length), self.pad_id, dtype=np.int64)
            mask = np.zeros((b, length), dtype=np.int64)
            for r, s in enumerate(seqs):
                input_ids[r, :len(s)] = s
                mask[r, :len(s)] = 1
            labels = np.where(mask == 1, input_ids, IGNORE_INDEX)
            real = int(mask.sum())
            stats["batches_out"] += 1
            stats["rows_out"] += b
            stats["tokens_out"] += real
            stats["padding_tokens"] += b * length - real
            yield {"input_ids": input_ids, "attention_mask": mask, "labels": labels}

    def stats(self) -> dict:
        """Counters so far plus ``padding_fraction`` = padding / all tokens of the batches."""
        s = dict(self._state.stats)
        total = s["tokens_out"] + s["padding_tokens"]
        s["padding_fraction"] = s["padding_tokens"] / total if total else 0.0
        return s

    def snapshot(self) -> _State:
        """A cheap copy of the current state (no token copies) for ``state_dict(snapshot)`` later."""
        st, snap = self._state, _State()
        snap.consumed, snap.round = st.consumed, st.round
        snap.ready = [list(batch) for batch in st.ready]
        snap.stats = dict(st.stats)
        return snap

    def state_dict(self, snapshot: _State | None = None) -> dict:
        """The resume point after the last batch yielded, or at ``snapshot``."""
        st = self._state if snapshot is None else snapshot
        seqs = [s for batch in st.ready for s in batch]
        return {
            "max_tokens": self.max_tokens,
            "sequences_consumed": st.consumed,
            "round": st.round,
            "ready": {
                "tokens": np.concatenate(seqs).astype(np.int64) if seqs else np.zeros(0, np.int64),
                "lengths": np.array([len(s) for s in seqs], dtype=np.int64),
                "batch_sizes": np.array([len(b) for b in st.ready], dtype=np.int64),
            },
            "stats": dict(st.stats),
        }

    def load_state_dict(self, state: dict, *, skip_consumed: bool = True) -> None:
        try:
            if int(state["max_tokens"]) != self.max_tokens:
                raise ValueError(f"state is for max_tokens {state['max_tokens']}, this batcher "
                                 f"has {self.max_tokens}")
            st = _State()
            st.consumed = int(state["sequences_consumed"])
            st.round = int(state["round"])
            r = state["ready"]
            tokens = np.asarray(r["tokens"], dtype=np.int64)
            lengths = np.asarray(r["lengths"], dtype=np.int64).tolist()
            ends = np.cumsum([0] + lengths).tolist()
            seqs = [tokens[a:e].copy() for a, e in zip(ends[:-1], ends[1:])]
            sizes = np.cumsum([0] + np.asarray(r["batch_sizes"]).tolist()).tolist()
            st.ready = [seqs[a:e] for a, e in zip(sizes[:-1], sizes[1:])]
            st.stats = {k: int(state["stats"][k]) for k in _STAT_KEYS}
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a TokenBudgetBatcher state_dict: {e!r}") from e
        self._state = st
        self._skip = st.consumed if skip_consumed else 0
        self._loaded = True
