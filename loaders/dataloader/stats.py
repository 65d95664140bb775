"""``stats()`` of ``loaders.DataLoader``: the pass's figures (:mod:`loaders.dataloader.progress`), the autotune
choices, the dataset's losses and the workers' shared memory in use.

A mixin of :class:`loaders.dataloader.DataLoader` (it reads the loader's attributes).
"""
from __future__ import annotations

from loaders.dataloader.progress import stats as pass_stats

__all__ = ["LoaderStats"]

LOSSES = ("skipped", "errors", "padded")
IO = ("retries", "shards_opened", "bytes_read", "cache_hits", "cache_failures")  # the stream's reads, as counted


class LoaderStats:
    """The ``stats()`` of :class:`loaders.dataloader.DataLoader`."""

    def stats(self) -> dict:
        """Figures of the current (or last) pass, the autotune choices and, when the dataset counts them, its losses.

        The pass (one ``iter()``; a resumed one counts from the resume): ``epoch``, ``samples``, ``batches``,
        ``elapsed_s``, ``samples_per_s``, ``batches_per_s``, ``wait_s`` (seconds the consumer waited for a
        batch), ``wait_fraction`` (of ``elapsed_s``), ``batch_bytes``, ``num_workers``, ``prefetch_depth``
        (``device`` set; else None), ``autotune`` (``num_workers="auto"`` / ``prefetch_depth="auto"`` choices).
        Losses (``ShardStream``, ``mix``: over the main process and the workers, each counted once):
        ``skipped`` (samples lost), ``errors`` (failures handled under ``on_error``) and ``padded`` (repeats
        that even out ranks) of the same pass as ``samples``; ``skipped_total``, ``errors_total``,
        ``padded_total``: the same over this loader's dataset since it was made; ``last_errors``: the latest
        messages. Its reads, the same way (this pass; ``..._total``): ``retries``, ``shards_opened`` (a shard split
        between workers is opened by each), ``bytes_read``, ``cache_hits``, ``cache_failures``.

        When the loader pins in its own thread (``device="cuda"``, or ``pin_memory=True`` with a GPU and workers),
        ``shared_memory``: the workers' tensors given back to them for reuse (``recycled``), the
        segments the main process holds mapped (``segments``) and of those the ones registered for CUDA,
        copied to the GPU in place (``registered``; ``device="cuda"``); once workers sent raw samples in shared
        memory, ``raw_shared_memory``: those batches (``batches``) and the segments held mapped (``segments``)."""
        out = pass_stats(self._progress, epoch=self._epoch, num_workers=self._workers_now(),
                         prefetch_depth=self._depth if self.device else None, tuning=self._auto,
                         prefetcher=self._prefetcher)
        losses = self._dataset_losses()
        for key in LOSSES + IO:
            if key in losses:  # this pass's, as "samples" is; the running totals beside
                out[key] = losses[key] - self._losses_before.get(key, 0)
                out[f"{key}_total"] = losses[key]
        if "last_errors" in losses:
            out["last_errors"] = losses["last_errors"]
        if self._returns is not None and self._pass_pins:
            r = self._returns
            out["shared_memory"] = {"recycled": r.released, "segments": len(r.kept), "registered": len(r.registered)}
        if self._raw is not None and self._raw.copied:
            out["raw_shared_memory"] = {"batches": self._raw.copied, "segments": len(self._raw.kept)}
        return out

    def _dataset_losses(self) -> dict:
        """The dataset's loss and read totals (``LOSSES``, ``IO``, ``last_errors``) when it counts them
        (``ShardStream``, ``mix``: over the main process and the workers, counted once), else ``{}``."""
        losses = getattr(self.dataset, "stats", None)
        ds = losses() if callable(losses) else None
        return {k: ds[k] for k in LOSSES + IO + ("last_errors",) if k in ds} \
            if isinstance(ds, dict) else {}
