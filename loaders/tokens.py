"""``TokenLoader``: tokenised documents from shards -> packed (or token-budget) batches on the device."""
from __future__ import annotations

import io
import logging
import time
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch

from datapipe.device.handoff import close_last
from datapipe.device.pacing import PACE, check_pace
from datapipe.device.prefetch import DevicePrefetcher
from datapipe.errors import DataError, ErrorPolicy, OnError
from datapipe.order.seeds import derive_seed
from datapipe.state import check_state
from datapipe.stream import ShardStream

log = logging.getLogger("datapipe.tokens")

BATCHING = ("packed", "dynamic")


def decode_npy(data) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _real_tokens(batch: dict) -> int:
    """Non-padding tokens of a host-side (numpy) batch."""
    if "attention_mask" in batch:
        return int(np.asarray(batch["attention_mask"]).sum())
    return int((np.asarray(batch["document_ids"]) >= 0).sum())


class TokenLoader:
    """Packed LLM batches from WebDataset shards of tokenised documents.

    Each sample holds one document: token ids as ``.npy`` (default ``token_key="npy"``), raw ints
    (``token_key="ids"`` with ``token_dtype``), or text (``text_key``) with a ``tokenizer`` callable
    (``str -> list[int]``). Documents stream through ``ShardStream`` (splitting, shuffling, resume,
    ``on_error``) into ``packing.Packer`` (``batching="packed"``: the packed-batch format of
    ``packing.batch``) or ``packing.TokenBudgetBatcher`` (``batching="dynamic"``: padded batches
    of at most ``max_tokens``), and reach ``device`` through ``DevicePrefetcher`` (``prefetch_depth``
    batches ahead, paced by ``pace``: see its docstring).

    When torch.distributed is initialised, ranks agree each step (a one-int all-reduce on a gloo
    group, started a step ahead so that it overlaps training) to stop together when the first runs
    out, so every rank yields the same number of batches; the few batches a rank drops at the end
    of the epoch are counted in ``stats()``.
    ``state_dict()`` is exact for the batches handed out, not the ones prefetched.
    ``on_error`` (a handler name or a callable, as for ``ShardStream``) also rules bad documents.
    ``seed`` orders the stream; the dynamic batcher shuffles with ``derive_seed(seed, 0, "token_budget")``.
    """

    def __init__(self, urls: str | list[str], *, seq_len: int, batch_size: int, device=None,
                 batching: str = "packed", max_tokens: int | None = None, pad_to_multiple_of: int = 8,
                 token_key: str = "npy", token_dtype: str = "int32", text_key: str = "txt",
                 tokenizer: Callable[[str], Any] | None = None, shuffle: bool = True, seed: int = 0,
                 shuffle_buffer: int = 1000, rank: int | None = None, world_size: int | None = None,
                 on_error: OnError = "raise", buffer_size: int = 2048, overflow: str = "split",
                 eos_id: int | None = None, bos_id: int | None = None, pad_id: int = 0, algorithm: str = "bfd",
                 prefetch_depth: int = 2, pace: float | None = PACE, sync_ranks: bool = True,
                 stream_options: dict | None = None):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError("seq_len and batch_size must be >= 1")
        self.stream = ShardStream(urls, shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer, rank=rank,
                                  world_size=world_size, on_error=on_error, **(stream_options or {}))
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.device = device
        self.batching = batching
        self.token_key = token_key
        self.token_dtype = np.dtype(token_dtype)
        self.text_key = text_key
        self.tokenizer = tokenizer
        self.on_error = on_error
        self._errors = ErrorPolicy(on_error, log=log)  # bad documents (the stream counts its own)
        self.prefetch_depth = prefetch_depth
        self.pace = check_pace(pace)
        self.sync_ranks = sync_ranks
        if batching == "packed":
            from packing import Packer

            self.batcher = Packer(seq_len, buffer_size=buffer_size, overflow=overflow, eos_id=eos_id, bos_id=bos_id,
                                  pad_id=pad_id, algorithm=algorithm)
        else:
            from packing import TokenBudgetBatcher

            self.batcher = TokenBudgetBatcher(max_tokens or seq_len * batch_size, buffer_size=buffer_size,
                                              max_batch_size=batch_size, pad_to_multiple_of=pad_to_multiple_of,
                                              seed=derive_seed(seed, 0, "token_budget"), pad_id=pad_id)
        self._delivered: dict[str, Any] | None = None  # snapshot after the last batch handed out
        self._resume: dict[str, Any] | None = None
        self._stats = {"batches": 0, "tokens": 0, "dropped_tail_batches": 0,
                       "wait_s": 0.0, "elapsed_s": 0.0}
        self._group = None
        self._producer = None  # the last pass's ProducerMeter
        self._last_pass = None  # weakref to the latest pass's iterator

    # ---- documents --------------------------------------------------------------------------
    def _document(self, sample: dict) -> np.ndarray | None:
        try:
            if self.token_key in sample:
                data = sample[self.token_key]
                ids = decode_npy(data) if self.token_key == "npy" else np.frombuffer(data, dtype=self.token_dtype)
            elif self.tokenizer is not None and self.text_key in sample:
                ids = np.asarray(self.tokenizer(bytes(sample[self.text_key]).decode("utf-8")), dtype=np.int64)
            else:
                raise KeyError(f"no {self.token_key!r} entry" + (f" and no {self.text_key!r} text" if self.tokenizer
                                                                 else " (give tokenizer= to read text)"))
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ValueError(f"token ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
            return ids
        except Exception as e:
            err = DataError(f"bad document: {type(e).__name__}: {e}", url=sample.get("__url__"), key=sample.get("__key__"))
            err.__cause__ = e
            self._errors(err)
            return None

    def _documents(self) -> Iterator[np.ndarray]:
        for sample in self.stream:
            ids = self._document(sample)
            if ids is not None:
                yield ids

    # ---- batches ----------------------------------------------------------------------------
    def _produce(self) -> Iterator[tuple[dict, dict]]:
        """Batches as torch tensors (host), each with the snapshot of the state right after it."""
        from packing.batch import to_torch

        batches = (self.batcher.batches(self._documents(), self.batch_size) if self.batching == "packed"
                   else self.batcher.batches(self._documents()))
        for batch in batches:
            snapshot = {"stream": self.stream.state_dict(), "batcher": self.batcher.snapshot(),
                        "tokens": _real_tokens(batch)}  # counted on the host: no device sync later
            yield to_torch(batch), snapshot

    def __iter__(self) -> Iterator[dict]:
        """One pass (an epoch, or its rest after a resume); one pass at a time: a new one stops the last."""
        close_last(self._last_pass)  # one pass at a time: the last one's producer thread stops first
        batches = self._pass()
        self._last_pass = weakref.ref(batches)
        return batches

    def _pass(self) -> Iterator[dict]:
        resume, self._resume = self._resume, None
        if resume is not None:
            self.stream.load_state_dict(resume["stream"])
            self.batcher.load_state_dict(resume["batcher"], skip_consumed=False)
            self._stats["batches"] = int(resume.get("batches", 0))
        else:
            self._stats["batches"] = 0
        group = self._sync_group()
        prefetcher = DevicePrefetcher(self._produce(), device=self.device, depth=self.prefetch_depth, pace=self.pace)
        self._producer = prefetcher.meter
        it = iter(prefetcher)
        start = time.perf_counter()

        def fetch():
            t0 = time.perf_counter()
            item = next(it, None)
            self._stats["wait_s"] += time.perf_counter() - t0
            return item

        def agree(item):  # started now, waited for one step later: its latency hides behind that step
            flag = torch.tensor([0 if item is None else 1], dtype=torch.int32)
            return flag, torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group,
                                                      async_op=True)

        try:
            item = fetch()
            pending = agree(item) if group is not None else None
            while True:
                if pending is not None:
                    t0 = time.perf_counter()
                    flag, work = pending
                    work.wait()
                    self._stats["wait_s"] += time.perf_counter() - t0
                    if item is not None and int(flag) == 0:  # another rank ran out: stop together
                        self._stats["dropped_tail_batches"] += 1 + sum(1 for _ in it)
                        item = None
                if item is None:
                    break
                batch, snapshot = item
                if group is not None:  # the next batch, and the ranks' agreement on it, while this one trains
                    item = fetch()
                    pending = agree(item)
                self._delivered = {"snapshot": snapshot, "batches": self._stats["batches"] + 1}
                self._stats["batches"] += 1
                self._stats["tokens"] += snapshot["tokens"]
                self._stats["elapsed_s"] = time.perf_counter() - start
                yield batch
                if group is None:
                    item = fetch()
        finally:
            prefetcher.close()

    def _sync_group(self):
        if not self.sync_ranks:
            return None
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    # ---- state ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)
        self._delivered = None

    def state_dict(self) -> dict:
        """The position after the last batch handed out (the prefetched ones are replayed on resume).

        Names the rank and world size it was taken on; the states of all ranks merge into one global
        state (``datapipe.order.elastic.merge_states`` / ``gather_state``) that resumes on any world size.
        """
        rank, world = self.stream._rank_world()
        if self._delivered is None:
            out = {"stream": self.stream.state_dict(), "batcher": self.batcher.state_dict(), "batches": 0}
        else:
            snap = self._delivered["snapshot"]
            out = {"stream": snap["stream"], "batcher": self.batcher.state_dict(snap["batcher"]),
                   "batches": self._delivered["batches"]}
        return {"kind": "TokenLoader", **out, "rank": rank, "world_size": world, "epoch": out["stream"]["epoch"]}

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Resume after the last batch of ``state``: this rank's own state, or the global state of all ranks.

        A global state (``datapipe.order.elastic.merge_states``, or the list of per-rank states) resumes on
        any world size: on the same one each rank takes its own state back (exact); on another, the
        stream replans the epoch's undelivered documents over the new ranks, and the token pieces
        that sat in the old ranks' packers are split among the new ranks' packers (contiguous equal
        shares in rank order), so every document of the epoch is packed exactly once (padding
        repeats aside). ``batching="packed"`` only.
        """
        from datapipe.order import elastic

        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(state)
        if elastic.is_global(state):
            rank, world = self.stream._rank_world()
            if state["world_size"] == world:
                state = state["ranks"][rank]
            else:
                state = self._reshape(state, rank, world)
        check_state(state, "TokenLoader", keys=("stream", "batcher"))
        self._resume = state

    def _reshape(self, g: dict, rank: int, world: int) -> dict:
        from datapipe.order import elastic

        if self.batching != "packed":
            raise ValueError("only batching='packed' resumes on another world size; use the same world size")
        from packing.packer import held_pieces, holding_state

        pieces = [p for rs in g["ranks"] for p in held_pieces(rs["batcher"])]
        share = pieces[rank * len(pieces) // world:(rank + 1) * len(pieces) // world]
        return {"stream": elastic.merge_states([rs["stream"] for rs in g["ranks"]]),
                "batcher": holding_state(self.seq_len, share), "batches": 0}

    def stats(self) -> dict:
        """Batches, tokens (real), tokens/s, consumer wait, plus the batcher's own counters (efficiency...)."""
        s = dict(self._stats)
        s["bad_documents"] = self._errors.skipped
        s["tokens_per_s"] = s["tokens"] / s["elapsed_s"] if s["elapsed_s"] else 0.0
        s["wait_fraction"] = s["wait_s"] / s["elapsed_s"] if s["elapsed_s"] else 0.0
        s.update(self.batcher.stats())
        s["stream"] = self.stream.stats()
        if self._producer is not None:  # the producer thread's CPU time (this pass)
            s["producer"] = self._producer.stats()
        return s
