"""Peers side by side: torch (loose files), webdataset, datapipe, litdata and MosaicML Streaming on the same images.

Each system writes the same image folder (class sub-folders of JPEGs) in its own native format with
its own writer (torch: a copy of the files; webdataset: ``wds.ShardWriter``; datapipe: ``datapipe shard``;
litdata: ``litdata.optimize`` over a function; MosaicML: ``streaming.MDSWriter``) and reads it with its
documented loader (torch's ``DataLoader`` over a files ``Dataset``, ``webdataset.WebDataset`` in torch's
``DataLoader``, ``loaders.DataLoader`` over a ``ShardStream``, ``litdata.StreamingDataset`` +
``StreamingDataLoader``, ``streaming.StreamingDataset`` + ``StreamingDataLoader``), shuffle on.

Rows (every row a fresh process, so that a first epoch is a first epoch):

- ``write``: images/s of the writer, end to end;
- ``raw``: samples/s of raw bytes (no decode) at each of ``workers`` (epoch 1 in the fresh process, then epoch 2);
- ``decode``: PIL decode + random-resized-crop + flip + normalise (:class:`~datapipe.tools.bench.baselines.PilTrain`)
  in ``decode_workers`` workers: steady samples/s after the first batch, the first batch's time, and the
  peak PSS (proportional set size, MB) of the process and its workers;
- ``resume``: a state taken half-way through an epoch in one process, loaded in a fresh one: time to the
  first batch after loading, and whether the rest is exactly the samples the first process went on to
  read (``exact``: the same samples, each once; ``same_order``: also in the same order).

litdata and MosaicML rows need the ``peers`` extra (``pip install 'datapipe[peers]'``); a system that
is not installed is reported as such, not measured.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from typing import Any, Callable

from datapipe.tools.bench.peer_readers import SYSTEMS, one_epoch, set_epoch_of, list_images, open_loader, read_item
from datapipe.tools.bench.peer_table import run_notes, summary, table_rows  # noqa: F401 (the table's names here too)

RESUMABLE = ("datapipe", "litdata", "mosaicml")
DISTRIBUTIONS = {"torch": "torch", "webdataset": "webdataset", "datapipe": "datapipe", "litdata": "litdata",
                 "mosaicml": "mosaicml-streaming"}
MODULES = {"litdata": "litdata", "mosaicml": "streaming"}


# ---- which systems ----------------------------------------------------------------------------------------
def version(system: str) -> str | None:
    """The installed version of ``system``'s distribution, ``None`` when it cannot be imported."""
    module = MODULES.get(system)
    if module is not None:
        import importlib.util

        if importlib.util.find_spec(module) is None:
            return None
    try:
        return metadata.version(DISTRIBUTIONS[system])
    except metadata.PackageNotFoundError:
        return "source tree" if system == "datapipe" else None


# ---- the source: an image folder ---------------------------------------------------------------------------
def make_image_folder(folder: str, *, num_images: int, num_classes: int = 10, size: tuple[int, int] = (500, 375),
                      seed: int = 0) -> str:
    """ImageNet-like JPEGs in ``folder/<class>/<key>.jpg`` (made once; an existing folder is kept)."""
    from datapipe.tools.synthetic import iter_image_samples

    if os.path.isdir(folder) and list_images(folder):
        return folder
    for s in iter_image_samples(num_images, seed=seed, num_classes=num_classes, size=size):
        d = os.path.join(folder, f"class{int(s['cls']):04d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, s["__key__"] + ".jpg"), "wb") as f:
            f.write(s["jpg"])
    return folder


def folder_from_shards(shards: list[str], folder: str) -> str:
    """The images of WebDataset shards (``jpg``/``png`` + ``cls``) as a class-folder tree: every system's source."""
    from datapipe import ShardStream
    from datapipe.tools.bench.baselines import image_bytes

    for s in ShardStream(shards, rank=0, world_size=1):
        d = os.path.join(folder, f"class{int(bytes(s['cls'])):04d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, s["__key__"].replace("/", "_") + ".jpg"), "wb") as f:
            f.write(bytes(image_bytes(s)))
    return folder


# ---- writers ------------------------------------------------------------------------------------------------
def write(system: str, source: str, out: str, *, workers: int) -> dict:
    """Write ``source`` in ``system``'s native format into ``out`` (which must not exist)."""
    items = list_images(source)
    t0 = time.perf_counter()
    if system == "torch":
        shutil.copytree(source, out)
    elif system == "webdataset":
        import webdataset as wds

        os.makedirs(out)
        with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=1 << 30, maxcount=100_000,
                             verbose=0) as sink:
            for item in items:
                s = read_item(item)
                sink.write({"__key__": s["key"].replace("/", "_"), "jpg": s["image"], "cls": s["cls"]})
    elif system == "datapipe":
        from datapipe.cli import main

        rc = main(["shard", source, out, "--no-progress", "--shuffle", "--workers", str(max(1, workers))])  # classes mixed
        if rc != 0:
            raise RuntimeError(f"datapipe shard exited {rc}")
    elif system == "litdata":
        from litdata import optimize

        optimize(fn=read_item, inputs=items, output_dir=out, chunk_bytes="64MB", num_workers=max(1, workers),
                 verbose=False)
    elif system == "mosaicml":
        from streaming import MDSWriter

        with MDSWriter(out=out, columns={"key": "str", "image": "bytes", "cls": "int"}) as sink:
            for item in items:
                sink.write(read_item(item))
    else:
        raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")
    seconds = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {"images": len(items), "seconds": round(seconds, 3), "images_per_s": round(len(items) / seconds, 1),
            "bytes": size}


# ---- rows (each run in a fresh process by run_peers) ---------------------------------------------------------
def row_raw(system: str, data: str, *, batch_size: int, workers: int, seed: int, cache_dir: str | None) -> dict:
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, cache_dir=cache_dir)
    first = one_epoch(loader)
    set_epoch_of(loader, 1)
    second = one_epoch(loader)
    return {"epoch1": first, "epoch2": second}


def row_decode(system: str, data: str, *, batch_size: int, workers: int, seed: int, image_size: int,
               cache_dir: str | None) -> dict:
    t0 = time.perf_counter()
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, decode_size=image_size,
                         cache_dir=cache_dir)
    it = iter(loader)
    keys, _, _ = next(it)
    first = time.perf_counter() - t0
    n, t1 = 0, time.perf_counter()
    for keys, _, _ in it:
        n += len(keys)
    seconds = time.perf_counter() - t1
    return {"first_batch_s": round(first, 3), "steady_samples": n,
            "steady_samples_per_s": round(n / seconds, 1) if n and seconds else None}


def row_resume_save(system: str, data: str, *, batch_size: int, workers: int, seed: int, state_path: str,
                    stop_after: int, cache_dir: str | None) -> dict:
    """``stop_after`` batches, the loader's state there, then the rest of the epoch it reads (saved for the load)."""
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, cache_dir=cache_dir)
    it = iter(loader)
    seen = []
    for _ in range(stop_after):
        seen += next(it)[0]
    state = loader.state_dict()
    rest = [k for keys, _, _ in it for k in keys]
    with open(state_path, "wb") as f:
        pickle.dump({"state": state, "seen": seen, "rest": rest}, f)
    return {"stopped_after_batches": stop_after, "seen_samples": len(seen), "rest_samples": len(rest)}


def row_resume_load(system: str, data: str, *, batch_size: int, workers: int, seed: int, state_path: str,
                    cache_dir: str | None) -> dict:
    with open(state_path, "rb") as f:
        saved = pickle.load(f)
    t0 = time.perf_counter()
    loader = open_loader(system, data, batch_size=batch_size, workers=workers, seed=seed, cache_dir=cache_dir)
    loader.load_state_dict(saved["state"])
    got, first = [], None
    for keys, _, _ in loader:
        if first is None:
            first = time.perf_counter() - t0
        got += keys
    exact = sorted(got) == sorted(saved["rest"]) and len(set(got)) == len(got) and not set(got) & set(saved["seen"])
    return {"first_batch_s": round(first, 3) if first is not None else None, "exact": exact,
            "same_order": got == saved["rest"], "resumed_samples": len(got), "expected_samples": len(saved["rest"])}


ROWS = {"raw": row_raw, "decode": row_decode, "resume_save": row_resume_save, "resume_load": row_resume_load}


IMPORTS = {"torch": ("torch.utils.data",), "webdataset": ("torch.utils.data", "webdataset"),
           # datapipe and loaders export lazily: name the modules that hold what the rows use
           "datapipe": ("torch.utils.data", "datapipe.stream", "loaders.dataloader", "datapipe.jobs.shard.cli"),
           "litdata": ("torch.utils.data", "litdata"), "mosaicml": ("torch.utils.data", "streaming")}


def _row_main(spec: dict) -> dict:
    """One row in this (fresh) process: the system's modules are imported first, their time reported apart."""
    import importlib

    t0 = time.perf_counter()
    for module in IMPORTS[spec["system"]] + ("PIL.Image",):
        importlib.import_module(module)
    imported = round(time.perf_counter() - t0, 3)
    kind = spec.pop("row")
    if kind == "write":
        out = write(spec["system"], spec["source"], spec["out"], workers=spec["workers"])
    else:
        system, data = spec.pop("system"), spec.pop("data")
        out = ROWS[kind](system, data, **spec)
    return {**out, "import_s": imported}


# ---- PSS of a process tree -------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def tree_pss_mb(pid: int) -> float | None:
    """PSS of ``pid`` and all its descendants, MB (``None`` where /proc has no smaps_rollup)."""
    total, todo, seen = 0, [pid], set()
    found = False
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        found = True
                        break
        except OSError:
            continue
        todo += _children(p)
    return round(total / 1024, 1) if found else None


def run_row(spec: dict, *, timeout: float) -> dict:
    """Run one row in a fresh Python process; its result, wall time and peak PSS of its process tree."""
    cmd = [sys.executable, "-c", "import json, sys; from datapipe.tools.bench.peers import _row_main; "
           "print('\\n' + json.dumps(_row_main(json.loads(sys.argv[1]))))", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak: list[float] = [0.0]
    done = threading.Event()

    def sample():
        while not done.wait(0.1):
            v = tree_pss_mb(proc.pid)
            if v is not None:
                peak[0] = max(peak[0], v)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        done.set()
        sampler.join()
    wall = round(time.perf_counter() - t0, 2)
    if proc.returncode != 0:
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}", "process_s": wall}
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "process_s": wall, "peak_pss_mb": peak[0] or None}


def _kill_tree(proc) -> None:
    for pid in [proc.pid] + _children(proc.pid):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


# ---- the run ------------------------------------------------------------------------------------------------------
def run_peers(source: str, *, work_dir: str | None = None, systems: list[str] | None = None, batch_size: int = 256,
              workers: tuple[int, ...] = (0, 4, 8), decode_workers: int | None = None, resume_workers: int = 0,
              image_size: int = 224, write_workers: int | None = None, seed: int = 0, timeout: float = 600.0,
              progress: bool = True, on_system: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Every row for every installed system, on the images of ``source`` (a class-folder tree).

    Args:
        source: folder of class sub-folders of JPEGs (see :func:`make_image_folder` / :func:`folder_from_shards`).
        work_dir: where each system writes its format (default: a temporary folder, removed after).
        systems: which of :data:`SYSTEMS` (default all; those not installed are listed as such).
        batch_size: samples per batch in every loader.
        workers: worker processes of the raw-bytes rows.
        decode_workers: worker processes of the decode row (default: the usable cores).
        resume_workers: worker processes of the resume rows.
        image_size: crop size of the decode row.
        write_workers: processes of the writers that take them (``datapipe shard``, ``litdata.optimize``).
        seed: the shuffle seed of every loader.
        timeout: seconds per row (a row over it is reported as timed out).
        progress: a line on stderr per row.
        on_system: called with the result so far (its table included) after each system's rows, so that a run
            cut short still leaves what it measured.
    """
    from datapipe.device.autotune import usable_cores

    chosen = list(systems or SYSTEMS)
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if batch_size < 1 or any(w < 0 for w in workers) or resume_workers < 0:
        raise ValueError("batch_size must be >= 1 and worker counts >= 0")
    images = list_images(source)
    if not images:
        raise ValueError(f"{source} holds no class folders of JPEGs: make one with make_image_folder")
    cores = usable_cores()
    decode_workers = cores if decode_workers is None else decode_workers
    write_workers = cores if write_workers is None else write_workers
    notes = []
    if len(images) // batch_size < 4:  # the decode and resume rows time what follows a first batch
        smaller = max(1, len(images) // 4)
        notes.append(f"{len(images)} images make {len(images) // batch_size} batch(es) of {batch_size}: batches of "
                     f"{smaller} instead, so that the decode and mid-epoch resume rows have batches to time")
        batch_size = smaller
    over = sorted({w for w in (*workers, decode_workers) if w > cores})
    if over:
        notes.append(f"worker counts {over} exceed the {cores} usable cores here: those rows share cores")
    own_tmp = work_dir is None
    work_dir = work_dir or tempfile.mkdtemp(prefix="datapipe-peers-")
    source_bytes = sum(os.path.getsize(p) for p, _, _ in images)
    result: dict[str, Any] = {
        "source": {"images": len(images), "bytes": source_bytes, "mean_kb": round(source_bytes / len(images) / 1e3, 1)},
        "settings": {"batch_size": batch_size, "workers": list(workers), "decode_workers": decode_workers,
                     "resume_workers": resume_workers, "image_size": image_size, "write_workers": write_workers,
                     "seed": seed, "shuffle": True, "timeout_s": timeout},
        "notes": notes, "systems": {}}

    def say(text):
        if progress:
            print(f"bench peers: {text}", file=sys.stderr, flush=True)

    try:
        for system in chosen:
            v = version(system)
            entry: dict[str, Any] = {"version": v}
            result["systems"][system] = entry
            if v is None:
                entry["error"] = f"not installed (pip install 'datapipe[peers]' for litdata and MosaicML)"
                say(f"{system}: not installed")
                continue
            data = os.path.join(work_dir, system)
            cache = os.path.join(work_dir, f"{system}-cache")
            if os.path.exists(data):
                shutil.rmtree(data)
            say(f"{system}: write")
            entry["write"] = run_row({"row": "write", "system": system, "source": source, "out": data,
                                      "workers": write_workers}, timeout=timeout)
            if "error" in entry["write"]:
                continue
            common = {"system": system, "data": data, "batch_size": batch_size, "seed": seed, "cache_dir": cache}
            entry["raw"] = {}
            for w in workers:
                say(f"{system}: raw bytes, {w} workers")
                entry["raw"][str(w)] = run_row({"row": "raw", **common, "workers": w}, timeout=timeout)
            say(f"{system}: decode, {decode_workers} workers")
            entry["decode"] = run_row({"row": "decode", **common, "workers": decode_workers,
                                       "image_size": image_size}, timeout=timeout)
            if system in RESUMABLE:
                say(f"{system}: resume")
                state = os.path.join(work_dir, f"{system}-state.pkl")
                half = max(1, -(-len(images) // batch_size) // 2)
                saved = run_row({"row": "resume_save", **common, "workers": resume_workers, "state_path": state,
                                 "stop_after": half}, timeout=timeout)
                entry["resume"] = saved if "error" in saved else {
                    **run_row({"row": "resume_load", **common, "workers": resume_workers, "state_path": state},
                              timeout=timeout), "saved": saved}
            else:
                entry["resume"] = {"error": "no mid-epoch resume"}
            if on_system is not None:
                on_system({**result, "table": summary(result), "partial": True})
    finally:
        if own_tmp:
            shutil.rmtree(work_dir, ignore_errors=True)
    result["table"] = summary(result)
    return result

