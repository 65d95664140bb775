"""Peers side by side: torch (loose files), webdataset, datapipe, litdata, MosaicML Streaming, SPDL, Grain and
Megatron-Energon on the same images.

Each system writes the same image folder (class sub-folders of JPEGs, :mod:`~datapipe.tools.bench.peer_images`) in
its own native format with its own writer (:mod:`~datapipe.tools.bench.peer_writers`: torch a copy of the files;
webdataset ``wds.ShardWriter``; datapipe ``datapipe shard``'s job; litdata ``litdata.optimize``; MosaicML
``streaming.MDSWriter``; Grain ArrayRecord files; Energon WebDataset tars + ``energon prepare``; SPDL, which has no
format, reads the files where they are) and reads it with its documented loader, shuffle on
(:mod:`~datapipe.tools.bench.peer_readers`, whose :func:`~datapipe.tools.bench.peer_readers.describe` words go into
every row as ``did``).

Rows, run system by system (its write, raw bytes, resume, decode; so that with ``drop_formats`` one format at a
time is on disk), every row in a fresh process
forked from a per-system process that has only imported that system (:mod:`~datapipe.tools.bench.peer_process`;
import time reported apart), so that a first epoch is a first epoch:

- ``write``: images/s of the writer, end to end;
- ``raw``: samples/s of raw bytes (no decode) at each of ``workers``: epoch 1 in the fresh process, then epoch 2,
  and the time to construct the loader and take its first batch;
- ``resume``: a state taken half-way through an epoch (``resume_workers`` workers), loaded in a fresh process:
  time to the first batch after loading; ``exact``: the rest is exactly the samples not yet read, each once;
  ``same_order``: its first batches are the ones the first process went on to read (Energon, whose documented
  save/restore runs an endless stream, is checked for that only);
- ``decode``: PIL decode + random-resized-crop + flip + normalise
  (:class:`~datapipe.tools.bench.baselines.PilTrain`) in ``decode_workers`` workers: the first batch's time, the
  steady rate over the next ``decode_seconds`` once every worker's first batch is in, and the peak PSS (MB) of the
  process tree; ``decode_own``: the same steps with a system's own decoder (datapipe's ImageLoader on DALI's CPU
  operators, :mod:`~datapipe.tools.bench.own_decode`).

``epoch_cap_s`` cuts an epoch that runs longer (the epoch is marked ``capped``); ``budget_s`` starts no row after
that many seconds (the rows left are marked as not run). Peers need the ``peers`` extra; a system that is not
installed is reported as such, not measured.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from typing import Any, Callable

from datapipe.tools.bench.peer_images import folder_from_shards, make_image_folder  # noqa: F401 (here too)
from datapipe.tools.bench.own_decode import OWN_DECODERS, row_decode_own
from datapipe.tools.bench.peer_readers import (SYSTEMS, describe, list_images, one_epoch, open_loader, set_epoch_of,
                                               steady_rate)
from datapipe.words import counted
from datapipe.tools.bench.peer_table import (SHORT_EPOCH_S, how_lines, run_notes, short_decodes,  # noqa: F401
                                             short_epochs, summary, table_rows)

RESUMABLE = ("datapipe", "litdata", "mosaicml", "grain", "energon")
ENDLESS = ("energon",)  # resumed over its default endless stream (its save/restore guide's way)
DISTRIBUTIONS = {"torch": "torch", "webdataset": "webdataset", "datapipe": "datapipe", "litdata": "litdata",
                 "mosaicml": "mosaicml-streaming", "spdl": "spdl", "grain": "grain", "energon": "megatron-energon"}
MODULES = {"litdata": "litdata", "mosaicml": "streaming", "spdl": "spdl.dataloader", "grain": "grain",
           "energon": "megatron.energon"}
NOT_INSTALLED = {  # why a peer may be missing beside the project's pins, and what to do
    "mosaicml": "not installed: MosaicML Streaming 0.13 pins numpy<2.2 and transformers<5, which the project's pins "
                "do not meet, and imports torchvision, whose wheels need another torch than the CPU 2.13 build here: "
                "where torch and torchvision match (the GPU host), pip install --no-deps mosaicml-streaming==0.13.0 "
                "brotli python-snappy cramjam zstd xxhash catalogue into a folder of its own and run with "
                "PYTHONPATH=DIR",
    "litdata": "not installed: pip install --no-deps litdata==0.2.76 obstore==0.12.1 (scripts/setup-venv.sh does; "
               "its resolver would otherwise pull another torch)",
}
PEERS_INSTALL = ("not installed: pip install -c constraints.txt spdl==0.8.0 grain==0.2.18 megatron-energon==7.4.1 "
                 "(scripts/setup-venv.sh does; without -c constraints.txt pip may replace the installed torch)")


# ---- which systems ----------------------------------------------------------------------------------------
def version(system: str) -> str | None:
    """The installed version of ``system``'s distribution, ``None`` when it cannot be imported."""
    module = MODULES.get(system)
    if module is not None:
        try:
            if importlib.util.find_spec(module) is None:
                return None
        except ImportError:  # a parent package that is not there
            return None
    try:
        return metadata.version(DISTRIBUTIONS[system])
    except metadata.PackageNotFoundError:
        return "source tree" if system == "datapipe" else None


# ---- rows (each run in a fresh process by run_peers) ---------------------------------------------------------
def row_raw(system: str, data: str, *, batch_size: int, workers: int, seed: int, cache_dir: str | None,
            cap_s: float | None = None) -> dict:
    """Epoch 1 in this fresh process, then epoch 2 (each cut at ``cap_s``). Where a cut epoch 1 goes on at the
    loader's next ``iter()`` (Energon's savable loader with workers), its rest is read first (``epoch1_rest``),
    so that epoch 2 is a pass of its own."""
    t0 = time.perf_counter()
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, cache_dir=cache_dir)
    construct = time.perf_counter() - t0
    first = one_epoch(loader, cap_s=cap_s)
    rest = None
    if first.get("capped") and getattr(loader, "continues_cut_pass", False):
        rest = one_epoch(loader)  # its next pass goes on with epoch 1: read its rest, untimed in the table
    set_epoch_of(loader, 1)
    second = one_epoch(loader, cap_s=cap_s)
    fb = first["first_batch_s"]
    return {"construct_s": round(construct, 3), "epoch1": first, **({"epoch1_rest": rest} if rest else {}),
            "epoch2": second, "construct_first_batch_s": round(construct + fb, 3) if fb is not None else None}


def row_decode(system: str, data: str, *, batch_size: int, workers: int, seed: int, image_size: int,
               cache_dir: str | None, seconds: float | None = None) -> dict:
    """The first batch's time, then the steady rate over the batches of the next ``seconds`` (or the epoch).

    The steady clock starts once every worker has handed over its first batch: the workers start together, so
    their first batches come within moments of each other, and a window that began at the first one would count
    that burst as rate (14 workers and a 3 s window: most of what it counted)."""
    from datapipe.tools.bench.baselines import close

    t0 = time.perf_counter()
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, decode_size=image_size,
                         cache_dir=cache_dir)
    it = iter(loader)
    try:
        next(it)
        first = time.perf_counter() - t0
        # the other workers' first batches, not timed
        steady = steady_rate(it, skip=max(0, workers - 1), seconds=seconds, count=lambda batch: len(batch[0]))
    finally:
        close(it)
    return {"first_batch_s": round(first, 3), **steady}


def row_resume_save(system: str, data: str, *, batch_size: int, workers: int, seed: int, state_path: str,
                    stop_after: int, verify_batches: int, cache_dir: str | None) -> dict:
    """``stop_after`` batches, the loader's state there, then the next ``verify_batches`` (saved for the load)."""
    import pickle

    from datapipe.tools.bench.baselines import close

    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, cache_dir=cache_dir,
                         endless=system in ENDLESS)
    it = iter(loader)
    seen, following = [], []
    try:
        for _ in range(stop_after):
            seen += next(it)[0]
        state = loader.state_dict()
        for _, (keys, _, _) in zip(range(verify_batches), it):
            following += keys
    finally:
        close(it)
    with open(state_path, "wb") as f:
        pickle.dump({"state": state, "seen": seen, "following": following}, f)
    return {"stopped_after_batches": stop_after, "seen_samples": len(seen), "following_samples": len(following)}


def row_resume_load(system: str, data: str, *, batch_size: int, workers: int, seed: int, state_path: str,
                    total: int, cache_dir: str | None) -> dict:
    """Load the saved state in this fresh process: time to the first batch, then the rest (of the epoch, or
    for an endless stream as many samples as the first process read after its state) checked."""
    import pickle

    from datapipe.tools.bench.baselines import close

    with open(state_path, "rb") as f:
        saved = pickle.load(f)
    endless = system in ENDLESS
    t0 = time.perf_counter()
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, cache_dir=cache_dir,
                         endless=endless)
    loader.load_state_dict(saved["state"])
    got, first = [], None
    it = iter(loader)
    try:
        for keys, _, _ in it:
            if first is None:
                first = time.perf_counter() - t0
            got += keys
            if endless and len(got) >= len(saved["following"]):
                break
    finally:
        close(it)
    following = saved["following"]
    out = {"first_batch_s": round(first, 3) if first is not None else None,
           "same_order": got[:len(following)] == following, "resumed_samples": len(got)}
    if endless:
        return {**out, "exact": None, "endless": True}
    seen = saved["seen"]
    exact = len(set(got)) == len(got) and not set(got) & set(seen) and len(got) + len(seen) == total
    return {**out, "exact": exact, "expected_samples": total - len(seen)}


ROWS = {"raw": row_raw, "decode": row_decode, "decode_own": row_decode_own, "resume_save": row_resume_save,
        "resume_load": row_resume_load}

IMPORTS = {"torch": ("torch.utils.data",), "webdataset": ("torch.utils.data", "webdataset"),
           # datapipe and loaders export lazily: name the modules that hold what the rows use
           "datapipe": ("torch.utils.data", "datapipe.stream", "loaders.dataloader", "datapipe.jobs.shard.job"),
           "litdata": ("torch.utils.data", "litdata"), "mosaicml": ("torch.utils.data", "streaming"),
           "spdl": ("torch.utils.data", "spdl.dataloader"),
           "grain": ("torch.utils.data", "grain", "array_record.python.array_record_module"),
           "energon": ("torch.utils.data", "webdataset", "megatron.energon")}
COMMON_IMPORTS = ("PIL.Image", "datapipe.tools.bench.peers", "datapipe.tools.bench.peer_writers")


def row_main(spec: dict) -> dict:
    """One row in this (fresh) process."""
    spec = dict(spec)
    kind = spec.pop("row")
    if kind == "write":
        from datapipe.tools.bench.peer_writers import write

        return write(spec["system"], spec["source"], spec["out"], workers=spec["workers"])
    system, data = spec.pop("system"), spec.pop("data")
    return ROWS[kind](system, data, **spec)


# ---- the run ------------------------------------------------------------------------------------------------------
class _Clock:
    """The run's budget: no row starts after it, and a row's timeout ends with it."""

    def __init__(self, budget_s: float | None, timeout: float):
        self.end = None if budget_s is None else time.monotonic() + budget_s
        self.budget_s, self.timeout = budget_s, timeout

    def timeout_now(self) -> float | None:
        if self.end is None:
            return self.timeout
        left = self.end - time.monotonic()
        return None if left <= 1.0 else min(self.timeout, left)


def run_peers(source: str, *, work_dir: str | None = None, systems: list[str] | None = None, batch_size: int = 256,
              workers: tuple[int, ...] = (0, 4, 8), decode_workers: int | None = None, resume_workers: int = 4,
              image_size: int = 224, write_workers: int | None = None, seed: int = 0, timeout: float = 600.0,
              epoch_cap_s: float | None = None, decode_seconds: float | None = 3.0, budget_s: float | None = None,
              progress: bool = True, on_row: Callable[[dict], None] | None = None,
              earlier: dict | None = None, drop_formats: bool = False) -> dict[str, Any]:
    """Every row for every installed system, on the images of ``source`` (a class-folder tree).

    Args:
        source: folder of class sub-folders of JPEGs (see :func:`make_image_folder` / :func:`folder_from_shards`).
        work_dir: where each system writes its format (default: a temporary folder, removed after).
        systems: which of :data:`SYSTEMS` (default all; those not installed are listed as such).
        batch_size: samples per batch in every loader.
        workers: worker processes (SPDL: threads) of the raw-bytes rows.
        decode_workers: worker processes of the decode row (default: the usable cores).
        resume_workers: worker processes of the resume rows.
        image_size: crop size of the decode row.
        write_workers: processes of the writers that take them (``datapipe shard``, ``litdata.optimize``,
            ``energon prepare``).
        seed: the shuffle seed of every loader.
        timeout: seconds per row (a row over it is reported as timed out).
        epoch_cap_s: cut a raw-bytes epoch after this many seconds (``None``: read every epoch to its end).
        decode_seconds: seconds of steady decoding timed after the first batch (``None``: the rest of the epoch).
        budget_s: start no row after this many seconds; the rows left say so (``None``: no budget).
        progress: a line on stderr per row.
        on_row: called with the result so far (its table included, ``partial``) after every row, so that a run
            cut short still leaves what it measured.
        earlier: the result of a run of the same settings and ``work_dir`` whose budget cut it short: its rows are
            kept (its formats too, where it wrote them) and only the rows it left unrun are run, each in a fresh
            process as ever: a run of record split over calls that each have a time limit.
        drop_formats: remove each system's format once all its rows are done, so that the run needs room on disk
            for the source and one format at a time (more images than eight formats would fit).
    """
    from datapipe.device.autotune import usable_cores
    from datapipe.tools.bench.peer_process import RowRunner
    from datapipe.tools.bench.peer_continue import ROWS_KEPT, all_finished, earlier_systems, finished
    from datapipe.tools.bench.peer_writers import FORMATS

    chosen = list(systems or SYSTEMS)
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if batch_size < 1 or any(w < 0 for w in workers) or resume_workers < 0:
        raise ValueError("batch_size must be >= 1 and worker counts >= 0")
    for name, v in (("epoch_cap_s", epoch_cap_s), ("decode_seconds", decode_seconds), ("budget_s", budget_s)):
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be > 0 seconds or None, got {v}")
    images = list_images(source)
    if not images:
        raise ValueError(f"{source} holds no class folders of JPEGs: make one with make_image_folder")
    cores = usable_cores()
    decode_workers = cores if decode_workers is None else decode_workers
    write_workers = cores if write_workers is None else write_workers
    notes = []
    if len(images) // batch_size < 4:  # the decode and resume rows time what follows a first batch
        smaller = max(1, len(images) // 4)
        notes.append(f"{counted(len(images), 'image')} make {counted(len(images) // batch_size, 'batch', 'batches')} "
                     f"of {batch_size}: batches of "
                     f"{smaller} instead, so that the decode and mid-epoch resume rows have batches to time")
        batch_size = smaller
    over = sorted({w for w in (*workers, decode_workers, resume_workers) if w > cores})
    if over:
        notes.append(f"worker counts {over} exceed the {cores} usable cores here: those rows share cores")
    own_tmp = work_dir is None
    work_dir = work_dir or tempfile.mkdtemp(prefix="datapipe-peers-")
    os.makedirs(work_dir, exist_ok=True)
    source_bytes = sum(os.path.getsize(p) for p, _, _ in images)
    result: dict[str, Any] = {
        "source": {"images": len(images), "bytes": source_bytes, "mean_kb": round(source_bytes / len(images) / 1e3, 1)},
        "settings": {"batch_size": batch_size, "workers": list(workers), "decode_workers": decode_workers,
                     "resume_workers": resume_workers, "image_size": image_size, "write_workers": write_workers,
                     "seed": seed, "shuffle": True, "timeout_s": timeout, "epoch_cap_s": epoch_cap_s,
                     "decode_seconds": decode_seconds, "budget_s": budget_s,
                     "processes": "every row a fresh process, forked from a per-system process that has only "
                                  "imported the system (import_s)"},
        "notes": notes, "systems": {}}
    before = earlier_systems(earlier, result["settings"], len(images))
    if before:
        result["settings"]["continues"] = (earlier.get("settings", {}).get("continues", [])
                                           + [earlier.get("environment", {}).get("date")])
    clock = _Clock(budget_s, timeout)

    def say(text):
        if progress:
            print(f"bench peers: {text}", file=sys.stderr, flush=True)

    def with_left_out() -> dict:
        """``result`` with the earlier run's systems this continuation leaves out, in :data:`SYSTEMS` order."""
        merged = {**{s: e for s, e in before.items() if s not in result["systems"]}, **result["systems"]}
        order = [s for s in SYSTEMS if s in merged] + [s for s in merged if s not in SYSTEMS]
        return {**result, "systems": {s: merged[s] for s in order}}

    def saved():  # the file a continuation read is rewritten whole, even if this call is cut short
        if on_row is not None:
            so_far = with_left_out()
            on_row({**so_far, "table": summary(so_far), "partial": True})

    runners: dict[str, RowRunner] = {}
    live = []
    for system in chosen:
        v = version(system)
        result["systems"][system] = entry = {"version": v, "how": {"format": FORMATS[system]}}
        if v is None:
            entry["error"] = NOT_INSTALLED.get(system, PEERS_INSTALL)
            say(f"{system}: not installed")
            continue
        entry["how"].update({f"{w} workers": describe(system, w) for w in sorted({*workers, resume_workers,
                                                                                  decode_workers})})
        runners[system] = RowRunner(list(IMPORTS[system] + COMMON_IMPORTS),
                                    target="datapipe.tools.bench.peers.row_main")
        live.append(system)

    def row(system: str, spec: dict, label: str, kept: Any = None) -> dict:
        if finished(kept):
            return kept
        limit = clock.timeout_now()
        if limit is None:
            return {"error": f"not run: the run's budget of {budget_s:g} s was spent"}
        say(f"{system}: {label}")
        out = runners[system].run({**spec, "system": system}, timeout=limit)
        if limit < timeout and str(out.get("error", "")).startswith("timed out"):
            out["error"] = f"stopped at the run's budget of {budget_s:g} s"
        if "did" not in out and spec["row"] != "write":
            out["did"] = describe(system, spec["workers"])
        return out

    try:
        for system in list(live):  # the imports, all started at once above: wait for each
            try:
                result["systems"][system]["import_s"] = runners[system].wait()
            except RuntimeError as e:
                result["systems"][system]["error"] = str(e)
                live.remove(system)
        data = {s: source if s == "spdl" else os.path.join(work_dir, s) for s in live}
        half = max(1, -(-len(images) // batch_size) // 2)

        def common(system):
            return {"data": data[system], "batch_size": batch_size, "seed": seed,
                    "cache_dir": os.path.join(work_dir, f"{system}-cache")}

        def rows_of(system: str, entry: dict, old: dict) -> None:
            """Every row of one system: write its format, read it (raw bytes at each worker count, resume,
            decode), then, with ``drop_formats``, remove the format."""
            own = system in OWN_DECODERS
            if all_finished(old, workers, own_decoder=own):  # an earlier run did every row (its format may be gone)
                entry.update({k: old[k] for k in ROWS_KEPT if k in old})
                return
            written = old.get("write")
            if not (finished(written) and "error" not in written and os.path.exists(data[system])):
                written = None
                if system != "spdl" and os.path.exists(data[system]):
                    shutil.rmtree(data[system])
            entry["write"] = row(system, {"row": "write", "source": source, "out": data[system],
                                          "workers": write_workers}, "write", written)
            saved()
            if "error" in entry["write"]:
                return
            if written is None and hasattr(os, "sync"):
                os.sync()  # the format's pages written back before its reads are timed (they stay in the page cache)
            for w in workers:
                entry.setdefault("raw", {})[str(w)] = row(system, {"row": "raw", **common(system), "workers": w,
                                                                   "cap_s": epoch_cap_s}, f"raw bytes, {w} workers",
                                                          (old.get("raw") or {}).get(str(w)))
                saved()
            if system not in RESUMABLE:
                entry["resume"] = {"error": "no mid-epoch resume"}
            elif finished(old.get("resume")):
                entry["resume"] = old["resume"]
            else:
                state = os.path.join(work_dir, f"{system}-state.pkl")
                save = row(system, {"row": "resume_save", **common(system), "workers": resume_workers,
                                    "state_path": state, "stop_after": half, "verify_batches": 4},
                           f"resume (save), {resume_workers} workers")
                entry["resume"] = save if "error" in save else {
                    **row(system, {"row": "resume_load", **common(system), "workers": resume_workers,
                                   "state_path": state, "total": len(images)},
                          f"resume (load), {resume_workers} workers"),
                    "saved": save}
                saved()
            entry["decode"] = row(system, {"row": "decode", **common(system), "workers": decode_workers,
                                           "image_size": image_size, "seconds": decode_seconds},
                                  f"decode, {decode_workers} workers", old.get("decode"))
            saved()
            if own:  # its own decoder too (own_decode)
                entry["decode_own"] = row(system, {"row": "decode_own", **common(system), "workers": decode_workers,
                                                   "image_size": image_size, "seconds": decode_seconds},
                                          f"own decoder, {decode_workers} threads", old.get("decode_own"))
                saved()
            if drop_formats and all_finished(entry, workers, own_decoder=own) and system != "spdl":
                shutil.rmtree(data[system], ignore_errors=True)

        for system in live:  # one system's rows after another's, so that one format at a time need be on disk
            rows_of(system, result["systems"][system], before.get(system, {}))
    finally:
        for r in runners.values():
            r.close()
        if own_tmp:
            shutil.rmtree(work_dir, ignore_errors=True)
    result = with_left_out()  # a continuation over fewer systems keeps the others' rows as the earlier run had them
    short = short_epochs(result, SHORT_EPOCH_S)
    if short:
        result["notes"].append(f"{len(short)} epochs read to their end took under {SHORT_EPOCH_S:.0f} s (more "
                               f"images make them longer): " + ", ".join(short[:6])
                               + (", ..." if len(short) > 6 else ""))
    short = short_decodes(result)
    if short:
        result["notes"].append(f"{len(short)} decode rows timed under the {decode_seconds:g} s asked (the epoch ended "
                               f"first; more images make them longer): " + ", ".join(short))
    result["table"] = summary(result)
    return result
