"""``TokenLoader``: tokenised documents from shards -> packed (or token-budget) batches on the device."""
from __future__ import annotations

import copy
import io
import logging
import time
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch

from datapipe.device.handoff import close_last
from datapipe.device.prefetch import DevicePrefetcher
from datapipe.errors import DataError, ErrorPolicy
from datapipe.order.ranks import rank_world
from datapipe.order.seeds import derive_seed
from datapipe.state import check_state
from loaders.source import as_stream, check_positive_int, option_group, stream_start
from loaders.tokens.options import DocumentOptions, PackOptions

log = logging.getLogger("datapipe.tokens")

SHUFFLE_BUFFER = 1000  # the sample shuffle buffer of a stream the loader builds from URLs


def decode_npy(data) -> np.ndarray:
    if isinstance(data, np.ndarray):  # a stream with .decode() steps gives arrays already
        return data
    return np.load(io.BytesIO(data), allow_pickle=False)


def _real_tokens(batch: dict) -> int:
    """Non-padding tokens of a host-side (numpy) batch."""
    if "attention_mask" in batch:
        return int(np.asarray(batch["attention_mask"]).sum())
    return int((np.asarray(batch["document_ids"]) >= 0).sum())


class TokenLoader:
    """Packed LLM batches from WebDataset shards of tokenised documents, on ``device``.

    Each sample holds one document: token ids as ``.npy`` (``documents.token_key``), raw ints, or
    text with a ``tokenizer``. Documents stream through the source ``ShardStream`` (splitting,
    shuffling, resume, ``on_error``) into ``packing.Packer`` (``packing.batching="packed"``: dicts
    of ``input_ids``, ``labels``, ``position_ids``, ``document_ids``, ``cu_seqlens``, ``max_seqlen``)
    or ``packing.TokenBudgetBatcher`` (``"dynamic"``: ``input_ids``, ``attention_mask``, ``labels``,
    padded), and reach ``device`` through ``DevicePrefetcher`` ``prefetch_depth`` batches ahead.
    No EOS token is added unless ``packing.eos_id`` is given.

    When torch.distributed is initialised, ranks agree each step (a one-int all-reduce on a gloo
    group, started a step ahead so that it overlaps training) to stop together when the first runs
    out, so every rank yields the same number of batches; the few batches a rank drops at the end
    of the epoch are counted in ``stats()``. ``state_dict()`` is exact for the batches handed out,
    not the ones prefetched. Bad documents follow the stream's ``on_error``.

    Epochs follow ``loaders.DataLoader``'s rule (:mod:`datapipe.order.shared_epoch`): every pass (one left
    early too) is the stream's next epoch, reshuffled, unless an epoch was chosen (``set_epoch``, a loaded
    state, ``stream.set_epoch``). Between passes ``state_dict()`` is the start of the next epoch.

    Args:
        source: a URL pattern, a list of URLs, a folder, or a :class:`datapipe.ShardStream` (used as it
            is: its shuffle, seed, rank, ``on_error``, storage and cache settings). From URLs the loader
            builds ``ShardStream(source, shuffle=True, shuffle_buffer=1000, seed=0)``.
        seq_len: tokens per row.
        batch_size: rows per batch (``"dynamic"``: at most this many).
        device: where batches go (``None``: stay on the CPU).
        tokenizer: ``str -> list[int]`` for samples that hold text instead of token ids.
        packing: :class:`~loaders.tokens.options.PackOptions` (batching, buffer, algorithm, ``eos_id``...).
        documents: :class:`~loaders.tokens.options.DocumentOptions` (which entries hold tokens or text).
        prefetch_depth: batches prepared ahead of the training loop.
        sync_ranks: stop every rank together (see above).
    """

    def __init__(self, source, *, seq_len: int, batch_size: int, device=None,
                 tokenizer: Callable[[str], Any] | None = None, packing: PackOptions | None = None,
                 documents: DocumentOptions | None = None, prefetch_depth: int = 2, sync_ranks: bool = True):
        self.seq_len = check_positive_int("seq_len", seq_len)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.prefetch_depth = check_positive_int("prefetch_depth", prefetch_depth)
        if tokenizer is not None and not callable(tokenizer):
            raise TypeError(f"tokenizer: pass a callable str -> list[int], got {type(tokenizer).__name__}")
        self.packing = packing = option_group(packing, PackOptions, "packing")
        self.documents = option_group(documents, DocumentOptions, "documents")
        self.stream = as_stream(source, shuffle=True, shuffle_buffer=SHUFFLE_BUFFER)
        self.device = device
        self.tokenizer = tokenizer
        self._token_dtype = np.dtype(self.documents.token_dtype)
        self._errors = ErrorPolicy(self.stream.on_error, log=log)  # bad documents (the stream counts its own)
        self.sync_ranks = bool(sync_ranks)
        if packing.batching == "packed":
            from packing import Packer

            self.batcher = Packer(self.seq_len, buffer_size=packing.buffer_size, overflow=packing.overflow,
                                  eos_id=packing.eos_id, bos_id=packing.bos_id, pad_id=packing.pad_id,
                                  algorithm=packing.algorithm)
        else:
            from packing import TokenBudgetBatcher

            self.batcher = TokenBudgetBatcher(packing.max_tokens or self.seq_len * self.batch_size,
                                              buffer_size=packing.buffer_size, max_batch_size=self.batch_size,
                                              pad_to_multiple_of=packing.pad_to_multiple_of,
                                              seed=derive_seed(self.stream.seed, 0, "token_budget"),
                                              pad_id=packing.pad_id)
        self._epoch_start_batcher = self.batcher.state_dict()  # the batcher's state before any document
        self._between_passes = True  # no pass under way: none yet, the last ran to its end, or set_epoch since
        self._pass_start: dict[str, Any] | None = None  # the state the pass under way started from
        self._delivered: dict[str, Any] | None = None  # snapshot after the last batch handed out in it
        self._resume: dict[str, Any] | None = None
        self._resumed = False  # the last pass began from a loaded state (see _drop_resume)
        self._stats = {"batches": 0, "tokens": 0, "dropped_tail_batches": 0,
                       "wait_s": 0.0, "elapsed_s": 0.0}
        self._bad_at_start = 0  # bad documents counted before this pass
        self._group = None
        self._producer = None  # the last pass's ProducerMeter
        self._last_pass = None  # weakref to the latest pass's iterator

    # ---- documents --------------------------------------------------------------------------
    def _document(self, sample: dict) -> np.ndarray | None:
        docs = self.documents
        try:
            if docs.token_key in sample:
                data = sample[docs.token_key]
                ids = decode_npy(data) if docs.token_key == "npy" else np.frombuffer(data, dtype=self._token_dtype)
            elif self.tokenizer is not None and docs.text_key in sample:
                text = sample[docs.text_key]
                text = text if isinstance(text, str) else bytes(text).decode("utf-8")
                ids = np.asarray(self.tokenizer(text), dtype=np.int64)
            else:
                raise KeyError(f"no {docs.token_key!r} entry" + (f" and no {docs.text_key!r} text" if self.tokenizer
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

        batches = (self.batcher.batches(self._documents(), self.batch_size) if self.packing.batching == "packed"
                   else self.batcher.batches(self._documents()))
        for batch in batches:
            snapshot = {"stream": self.stream.state_dict(), "batcher": self.batcher.snapshot(),
                        "tokens": _real_tokens(batch)}  # counted on the host: no device sync later
            yield to_torch(batch), snapshot

    def __iter__(self) -> Iterator[dict]:
        """One pass (an epoch, or its rest after a resume); one pass at a time: a new one stops the last."""
        close_last(self._last_pass)  # one pass at a time: the last one's producer thread stops first
        batches = self._pass(self._begin_pass())
        self._last_pass = weakref.ref(batches)
        return batches

    def _begin_pass(self) -> int:
        """The pass's epoch and start: a loaded state's, else the stream's next epoch (every pass begun counts,
        :meth:`datapipe.order.shared_epoch.SharedEpoch.begin_pass`). Returns the epoch's batches handed out."""
        resume, self._resume = self._resume, None
        if resume is not None:
            self.stream.load_state_dict(resume["stream"])  # chooses the state's epoch
            self.batcher.load_state_dict(resume["batcher"], skip_consumed=False)
        elif self._resumed:  # what the last pass loaded and left unread stays out of this one
            self._drop_resume()
        self._resumed = resume is not None
        epoch = self.stream.begin_pass()
        self._pass_start = resume if resume is not None else self._epoch_start(epoch)
        self._delivered = None
        self._between_passes = False
        return int(self._pass_start.get("batches", 0))

    def _drop_resume(self) -> None:
        """Drop what a resumed pass loaded and may have left untaken: the batcher's buffered documents (a pass never
        read from) and the stream's position (one never read from, or one that read only the batcher's buffered
        documents: the stream takes its position only when first read), so that neither spills into a later pass."""
        self.stream.forget_resume()
        self.batcher.load_state_dict(copy.deepcopy(self._epoch_start_batcher), skip_consumed=False)

    def _epoch_start(self, epoch: int) -> dict:
        """The state of the start of ``epoch``: nothing read, nothing packed."""
        return {"stream": stream_start(self.stream.state_dict(), epoch),
                "batcher": copy.deepcopy(self._epoch_start_batcher), "batches": 0}

    def _pass(self, batches_before: int) -> Iterator[dict]:
        # this pass's counts start here (batches, like the batcher's counters, are the epoch's: a resume restores them)
        self._stats.update(batches=batches_before, tokens=0, wait_s=0.0, elapsed_s=0.0, dropped_tail_batches=0)
        self._bad_at_start = self._errors.skipped
        group = self._sync_group()
        prefetcher = DevicePrefetcher(self._produce(), device=self.device, depth=self.prefetch_depth)
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
                    self._stats["elapsed_s"] = time.perf_counter() - start  # the last wait counted too
                    self._between_passes = True  # ran to its end: the state is the next epoch's start
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
        """The epoch of the next pass; the passes after it count on from it. A loaded state of another epoch is
        dropped (one of that epoch is kept), as ``loaders.DataLoader`` does."""
        if self._resume is not None and int(self._resume["stream"]["epoch"]) != int(epoch):
            self._resume = None
        self.stream.set_epoch(epoch)
        self._between_passes = True

    def state_dict(self) -> dict:
        """The position after the last batch handed out (the prefetched ones are replayed on resume); between
        passes (the last ran to its end, or ``set_epoch`` since) the start of the next epoch, ``batches`` 0.

        Names the rank and world size it was taken on; the states of all ranks merge into one global
        state (``datapipe.order.elastic.merge_states`` / ``gather_state``) that resumes on any world size.
        """
        rank, world = rank_world(self.stream)
        if self._resume is not None:  # loaded, not iterated yet
            out = self._resume
        elif self._between_passes:
            out = self._epoch_start(self.stream.next_pass_epoch())
        elif self._delivered is None:
            out = self._pass_start
        else:
            snap = self._delivered["snapshot"]
            out = {"stream": snap["stream"], "batcher": self.batcher.state_dict(snap["batcher"]),
                   "batches": self._delivered["batches"]}
        out = {"stream": out["stream"], "batcher": out["batcher"], "batches": int(out.get("batches", 0))}
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
            rank, world = rank_world(self.stream)
            if state["world_size"] == world:
                state = state["ranks"][rank]
            else:
                state = self._reshape(state, rank, world)
        check_state(state, "TokenLoader", keys=("stream", "batcher"))
        self._resume = state

    def _reshape(self, g: dict, rank: int, world: int) -> dict:
        from datapipe.order import elastic

        if self.packing.batching != "packed":
            raise ValueError("only batching='packed' resumes on another world size; use the same world size")
        from packing.packer import held_pieces, holding_state

        pieces = [p for rs in g["ranks"] for p in held_pieces(rs["batcher"])]
        share = pieces[rank * len(pieces) // world:(rank + 1) * len(pieces) // world]
        return {"stream": elastic.merge_states([rs["stream"] for rs in g["ranks"]]),
                "batcher": holding_state(self.seq_len, share), "batches": 0}

    def stats(self) -> dict:
        """The current (or last) pass: tokens (real), tokens/s, the consumer's wait and its share of the pass's
        time, bad documents, tail batches dropped; the epoch so far (the same without a resume; a resume restores
        them): ``batches`` and the batcher's counters (efficiency...); since the stream was made: ``stream``."""
        s = dict(self._stats)
        s["bad_documents"] = self._errors.skipped - self._bad_at_start
        s["tokens_per_s"] = s["tokens"] / s["elapsed_s"] if s["elapsed_s"] else 0.0
        s["wait_fraction"] = s["wait_s"] / s["elapsed_s"] if s["elapsed_s"] else 0.0
        s.update(self.batcher.stats())
        s["stream"] = self.stream.stats()
        if self._producer is not None:  # the producer thread's CPU time (this pass)
            s["producer"] = self._producer.stats()
        return s
