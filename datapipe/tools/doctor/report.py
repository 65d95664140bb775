"""``datapipe.doctor``: where a training loop's step time goes (waiting for data vs computing), with advice.

Minimal use::

    with datapipe.doctor(report="doctor.json") as d:
        for batch in d.wrap(loader):
            step(batch)

Time spent inside the loader's ``next()`` is *wait*; time from a batch's arrival to the next
``next()`` call (or to ``d.step()``, when you call it) is *compute*; the rest of the wall time
(between ``d.step()`` and the next ``next()``, between epochs) is *other*. Without ``wrap``, call
``d.data_ready()`` when a batch is in hand and ``d.step()`` when the step is done. When CUDA is in
use, ``cuda_sync`` (default: on once CUDA is initialised) synchronises at the end of each step, so
asynchronous GPU work is counted as compute, not as wait. ``probe_capacity=True`` pulls batches
from the loader without a consumer for ``probe_seconds`` at the end, measuring what the input
pipeline can deliver on its own. The advice is drawn from the measurements, each with the number
that triggered it.

``datapipe doctor [--json F] [--plot F.png] -- SCRIPT [ARGS...]`` runs a script with the doctor
installed around ``torch.utils.data.DataLoader`` and the ``loaders`` loaders.

The parts: this module records and assembles the report; :mod:`datapipe.tools.doctor.timed` times a
loader's iterations, :mod:`datapipe.tools.doctor.ceiling` measures the data-free ceiling,
:mod:`datapipe.tools.doctor.advice` draws the advice, :mod:`datapipe.tools.doctor.report_text` prints it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterable

from datapipe.device.autotune import usable_cores
from datapipe.device.step_kind import step_kind
from datapipe.tools.doctor.advice import _torch, advise, inspect_batch
from datapipe.tools.doctor.ceiling import CeilingReplay, ceiling_meaning
from datapipe.tools.doctor.report_text import format_report
from datapipe.tools.doctor.timed import TimedIteration, WrappedLoader
from datapipe.units import percentiles

__all__ = ["Doctor", "doctor", "format_report", "advise", "inspect_batch", "ceiling_meaning", "loader_losses"]


def _cuda_available() -> bool:
    torch = _torch()
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def _max_connections() -> int | None:
    """The CUDA_DEVICE_MAX_CONNECTIONS the user's environment sets (a fact for the advice; None when unset)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _percentiles(values: list[float]) -> dict:
    return percentiles(values, scale=1e3, digits=3, mean=True)


# ---- the doctor ------------------------------------------------------------------------------------------

def _decoder_load(loader) -> float | None:
    """An ImageLoader's hardware decoder share in use now (None for other loaders)."""
    hw = getattr(loader, "hw_decoder_load", None)
    return hw if isinstance(hw, float) else None


LOSSES = ("skipped", "errors", "padded")


def _decoder_moves(loader) -> bool:
    """Whether the loader moves between JPEG decoders by itself (``"auto"``, or the CUDA decoder its default chose)."""
    if getattr(getattr(loader, "decode", None), "hw_decoder_load", None) == "auto":
        return True
    decoder = _loader_stats(loader).get("decoder")
    return bool(isinstance(decoder, dict) and decoder.get("switchable"))


def _loader_stats(loader) -> dict:
    """``loader.stats()``, or ``{}`` for a loader without it (torch's) or whose ``stats()`` fails: a report never
    fails on a loader's figures."""
    stats = getattr(loader, "stats", None)
    try:
        s = stats() if callable(stats) else None
    except Exception:  # noqa: BLE001
        return {}
    return s if isinstance(s, dict) else {}


def loader_losses(loader) -> dict[str, int]:
    """What a loader's ``stats()`` counts as lost since it was made: ``skipped`` samples, ``errors`` handled under
    ``on_error``, ``padded`` repeats (``loaders.DataLoader``'s ``*_total``, else the loader's own counts, else its
    stream's); ``{}`` for a loader without ``stats()`` (torch's)."""
    s = _loader_stats(loader)
    stream = s.get("stream") if isinstance(s.get("stream"), dict) else {}
    out = {}
    for key in LOSSES:
        value = next((v for v in (s.get(f"{key}_total"), s.get(key), stream.get(key))
                      if isinstance(v, int) and not isinstance(v, bool)), None)
        if value is not None:
            out[key] = value
    return out


def gpu_hold_seconds(loader) -> float:
    """Seconds a loader's ``next()`` spent waiting for the GPU's last step (ImageLoader's ``step_hold``,
    active with few CUDA hardware queues): the loop waited for its own step there, not for data."""
    hold = _loader_stats(loader).get("step_hold")
    seconds = hold.get("seconds") if isinstance(hold, dict) else None
    return float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else 0.0


class Doctor(CeilingReplay):
    """Measures data wait vs compute of a training loop; see the module docstring. Use as a context manager."""

    def __init__(self, *, report: str | None = None, plot: str | None = None, probe_capacity: bool = False,
                 probe_seconds: float = 2.0, cuda_sync: bool | None = None, print_report: bool = True,
                 inspect_every: int = 50, ceiling_steps: int = 0, ceiling_after: int = 5):
        if probe_seconds <= 0:
            raise ValueError(f"probe_seconds must be > 0, got {probe_seconds}")
        if inspect_every < 1:
            raise ValueError(f"inspect_every must be >= 1, got {inspect_every}")
        if isinstance(ceiling_steps, bool) or not isinstance(ceiling_steps, int) or ceiling_steps < 0:
            raise ValueError(f"ceiling_steps must be an int >= 0, got {ceiling_steps!r}")
        if isinstance(ceiling_after, bool) or not isinstance(ceiling_after, int) or ceiling_after < 1:
            raise ValueError(f"ceiling_after must be an int >= 1, got {ceiling_after!r}")
        self.ceiling_steps = ceiling_steps
        self.ceiling_after = ceiling_after
        self._replay = None  # the batch replayed through the user's step (the data-free ceiling)
        self._replay_left = 0
        self._replay_t0: float | None = None
        self._replay_s = 0.0
        self._replay_end_step: int | None = None
        self._replay_end = 0.0
        self._ceiling: dict | None = None
        self._replayed_batches = 0  # extra batches handed to the user's loop by the replay
        self.report_path = report
        self.plot_path = plot
        self.probe_capacity = probe_capacity
        self.probe_seconds = probe_seconds
        self.cuda_sync = cuda_sync
        self.print_report = print_report
        self.inspect_every = inspect_every
        self._created = time.perf_counter()
        self._wait_from: float | None = None
        self._ready_at: float | None = None
        self._last_end: float | None = None
        self._first: float | None = None
        self._steps: list[tuple[float, float, float]] = []  # (end, wait, compute)
        self._batch = {"inspected": 0, "pad": 0, "positions": 0, "batch_size": None, "devices": set(),
                       "unpinned_host_tensors": 0, "images_on_host": None, "jpeg_bytes": False}
        self._loaders: list[dict] = []
        self._loader_objs: list = []
        self._probing = False
        self._pending_wait = 0.0
        self._entry: dict | None = None
        self._capacity: dict | None = None
        self._finished: dict | None = None

    # ---- recording --------------------------------------------------------------------------------------
    def wrap(self, loader: Iterable) -> Iterable:
        """``loader``, timed: iterate it as usual (epoch after epoch)."""
        return WrappedLoader(self, loader)

    def _timed(self, loader, it) -> TimedIteration:
        entry = next((e for e, o in zip(self._loaders, self._loader_objs) if o is loader), None)
        if entry is None:
            workers = getattr(loader, "num_workers", None)
            entry = {"type": f"{type(loader).__module__}.{type(loader).__qualname__}",
                     "num_workers": workers if isinstance(workers, int) else None,
                     "hw_decoder_load": _decoder_load(loader),
                     "hw_decoder_auto": _decoder_moves(loader),
                     "pin_memory": getattr(loader, "pin_memory", None), "batches": 0,
                     "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
                     "reiterable": it is not loader, "wait_s": 0.0, "compute_s": 0.0, "startup_wait_s": 0.0,
                     "iterations": 0}
            self._loaders.append(entry)
            self._loader_objs.append(loader)
        entry["iterations"] += 1
        return TimedIteration(self, it, entry)

    def _wait_start(self) -> None:
        now = time.perf_counter()
        if self._ready_at is not None:
            self._end_step(now)
        self._wait_from = now

    def _ready(self, batch=None, entry: dict | None = None) -> None:
        now = time.perf_counter()
        if self._ready_at is not None:  # data_ready() inside a wrapped loop: already counted
            return
        self._entry = entry
        start = self._wait_from if self._wait_from is not None else (
            self._last_end if self._last_end is not None else self._created)
        if self._first is None:
            self._first = start
        self._wait_from = None
        self._ready_at = now
        self._pending_wait = now - start
        n = len(self._steps)
        if batch is not None and (n < 3 or n % self.inspect_every == 0):
            self._inspect(batch)

    def _exhausted(self) -> None:
        self._wait_from = None

    def _end_step(self, now: float) -> None:
        if self._ready_at is None:
            return
        self._steps.append((now, self._pending_wait, now - self._ready_at))
        if self._entry is not None:
            self._entry["wait_s"] += self._pending_wait
            self._entry["compute_s"] += now - self._ready_at
            if self._entry.pop("_first", False):
                self._entry["startup_wait_s"] += self._pending_wait
        self._ready_at = None
        self._last_end = now

    def data_ready(self, batch=None) -> None:
        """A batch is in hand (manual API): the time since the last ``step()`` was waiting for it."""
        self._ready(batch)

    def step(self) -> None:
        """The training step is done (optional inside ``wrap``): ends the compute part of this step."""
        if self._sync():
            _torch().cuda.synchronize()
        self._end_step(time.perf_counter())

    def _sync(self) -> bool:
        if self.cuda_sync is not None:
            return self.cuda_sync and _cuda_available()
        torch = _torch()
        return bool(torch is not None and _cuda_available() and torch.cuda.is_initialized())

    def _inspect(self, batch) -> None:
        info = inspect_batch(batch)
        b = self._batch
        b["inspected"] += 1
        b["pad"] += info["pad"]
        b["positions"] += info["positions"]
        if info.get("padding_source"):
            b["padding_source"] = info["padding_source"]
        b["batch_size"] = b["batch_size"] or info["batch_size"]
        b["devices"] |= set(info["devices"])
        b["unpinned_host_tensors"] = max(b["unpinned_host_tensors"], info["unpinned_host_tensors"])
        b["images_on_host"] = b["images_on_host"] or info["images_on_host"]
        b["jpeg_bytes"] |= info["jpeg_bytes"]

    # ---- capacity probe ---------------------------------------------------------------------------------
    def _probe(self) -> dict:
        candidates = [(e["wait_s"], i) for i, e in enumerate(self._loaders) if e["reiterable"]]
        loader = self._loader_objs[max(candidates)[1]] if candidates else None
        if loader is None:
            return {"capacity_batches_per_s": None, "probe": "not measured: no re-iterable loader was wrapped"}
        self._probing = True
        n, t_first = 0, None
        it = iter(loader)
        try:
            for _ in it:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now  # worker start-up is not capacity
                    continue
                n += 1
                if now - t_first >= self.probe_seconds:
                    break
        finally:
            self._probing = False
            for name in ("_shutdown_workers", "close"):
                fn = getattr(it, name, None)
                if callable(fn):
                    fn()
        if t_first is None or n == 0:
            return {"capacity_batches_per_s": None, "probe": "not measured: the loader gave fewer than 2 batches"}
        return {"capacity_batches_per_s": round(n / (time.perf_counter() - t_first), 3),
                "probe": f"{n} batches pulled without a consumer"}

    # ---- the report ---------------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The measurements so far, with advice (see :func:`advise`)."""
        steps = self._steps
        held = min(sum(gpu_hold_seconds(x) for x in self._loader_objs), sum(s[1] for s in steps))
        wait = sum(s[1] for s in steps) - held  # next() waiting for the GPU's last step is the step's own time
        compute = sum(s[2] for s in steps) + held
        wall = (steps[-1][0] - self._first - self._replay_s) if steps else 0.0  # the replay is not the run
        other = max(0.0, wall - wait - compute)

        def frac(x):
            return round(x / wall, 4) if wall > 0 else 0.0

        b = self._batch
        bs = b["batch_size"]
        batch = {k: v for k, v in b.items() if k not in ("pad", "positions")}
        batch["devices"] = sorted(b["devices"])
        batch["padding_fraction"] = round(b["pad"] / b["positions"], 4) if b["positions"] else None
        mean_compute = compute / len(steps) if steps else 0.0
        rates = {"observed_batches_per_s": round(len(steps) / wall, 3) if wall > 0 else None,
                 "observed_samples_per_s": round(len(steps) * bs / wall, 2) if wall > 0 and bs else None,
                 "consumption_batches_per_s": round(1 / mean_compute, 3) if mean_compute > 0 else None,
                 "capacity_batches_per_s": None, "probe": "not requested (probe_capacity=True)"}
        rates.update(self._capacity or {})
        for entry, loader in zip(self._loaders, self._loader_objs):  # "auto" may have switched since
            entry["hw_decoder_load"] = _decoder_load(loader)
            entry["losses"] = loader_losses(loader)
            decoder = _loader_stats(loader).get("decoder")
            if isinstance(decoder, dict):  # ImageLoader: which JPEG decoder, its threads, whether it moved
                entry["decoder"] = decoder
        torch = _torch()
        cuda = _cuda_available()
        out = {
            "steps": len(steps), "wall_s": round(wall, 4), "wait_s": round(wait, 4), "compute_s": round(compute, 4),
            "other_s": round(other, 4), "gpu_hold_s": round(held, 4), "wait_fraction": frac(wait), "compute_fraction": frac(compute),
            "other_fraction": frac(other),
            "step_ms": _percentiles([s[1] + s[2] for s in steps]), "wait_ms": _percentiles([s[1] for s in steps]),
            "compute_ms": _percentiles([s[2] for s in steps]),
            "rates": rates, "batch": batch, "loaders": [self._loader_summary(e) for e in self._loaders],
            "loader": self._loader_summary(max(self._loaders, key=lambda e: e["wait_s"])) if self._loaders else {},
            "cores": usable_cores(), "cuda": cuda, "cuda_device_max_connections": _max_connections(),
            "gpu": torch.cuda.get_device_name() if cuda else "none", "cuda_sync": self._sync(),
            "timeline": self._timeline(), "step": step_kind(),
        }
        out.update(self._ceiling_report())
        out["advice"] = advise(out)
        return out

    @staticmethod
    def _loader_summary(e: dict) -> dict:
        """Per loader; ``steady_wait_fraction`` leaves out each iteration's first batch (its start-up)."""
        e = {k: v for k, v in e.items() if not k.startswith("_")}
        busy = e["wait_s"] + e["compute_s"]
        steady = busy - e["startup_wait_s"]
        return {**e, "wait_s": round(e["wait_s"], 4), "compute_s": round(e["compute_s"], 4),
                "startup_wait_s": round(e["startup_wait_s"], 4),
                "wait_fraction": round(e["wait_s"] / busy, 4) if busy > 0 else 0.0,
                "steady_wait_fraction": round((e["wait_s"] - e["startup_wait_s"]) / steady, 4) if steady > 0 else 0.0}

    def _timeline(self, points: int = 200) -> dict:
        steps = self._steps
        if not steps:
            return {"t_s": [], "wait_fraction": [], "steps_per_point": 0}
        per = max(1, len(steps) // points)
        t, w = [], []
        for i in range(0, len(steps), per):
            chunk = steps[i:i + per]
            total = sum(s[1] + s[2] for s in chunk)
            t.append(round(chunk[-1][0] - self._first, 4))
            w.append(round(sum(s[1] for s in chunk) / total, 4) if total > 0 else 0.0)
        return {"t_s": t, "wait_fraction": w, "steps_per_point": per}

    def finish(self) -> dict[str, Any]:
        """End the measurement: probe capacity (if asked), write the JSON / PNG, print; returns the report."""
        if self._finished is not None:
            return self._finished
        if self._ready_at is not None:
            self._end_step(time.perf_counter())
        if self.probe_capacity:
            try:
                self._capacity = self._probe()
            except Exception as e:
                self._capacity = {"capacity_batches_per_s": None, "probe": f"failed: {type(e).__name__}: {e}"}
        rep = self.report()
        if self.report_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.report_path)), exist_ok=True)
            with open(self.report_path, "w") as f:
                json.dump(rep, f, indent=1, default=str)
                f.write("\n")
        if self.plot_path and rep["steps"]:
            from datapipe.tools.plots import plot_doctor

            plot_doctor(rep, self.plot_path)
        if self.print_report:
            print(format_report(rep), file=sys.stderr)
        self._finished = rep
        return rep

    def __enter__(self) -> Doctor:
        self._created = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def doctor(*, report: str | None = None, plot: str | None = None, **kwargs) -> Doctor:
    """A :class:`Doctor` (use it as a context manager); ``plot`` defaults to the report path with ``.png``."""
    if plot is None and report:
        plot = os.path.splitext(report)[0] + ".png"
    return Doctor(report=report, plot=plot, **kwargs)

