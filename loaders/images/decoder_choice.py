"""``DecodeOptions(hw_decoder_load=None | "auto")``: which JPEG decoder runs, chosen by the loader.

nvJPEG's CUDA decoder (the Huffman stage on DALI's CPU threads, the rest on the GPU) decodes ~3x
slower than the GPU's hardware decoder and uses more cores, but can slow a training step beside it
less. ``"auto"`` starts on the CUDA decoder where the process has the cores for it, and moves to the
hardware decoder once the consumer is seen starved of batches, and moves back only if the loop then runs
slower (on few queues: clearly slower):

- the first ``SKIP`` batches of every iteration are not judged (pipeline start, warm-up);
- then, over windows of ``WINDOW`` batches, the consumer's *starved* time against the wall time: the part of
  each wait in ``next()`` during which its GPU stream had nothing left to run
  (:class:`datapipe.device.idle_watch.IdleWatch`). A loop that runs ahead of the GPU, and one under CUDA graphs
  whose host waits most of each step in ``next()`` while the GPU still runs it, starve nothing while the GPU
  works through queued steps. (The judge before counted a wait whole when the stream was idle as the batch
  came: under CUDA graphs that over-counted and moved every time.) Above the threshold the loader is starving
  the loop; above the early threshold after ``EARLY`` batches of a window it switches without waiting for the
  window's end. The thresholds follow the hardware decoder's own cost: none on wide queues (``THRESHOLD``,
  2%); on few queues it slows the step itself (``FEW_QUEUES_THRESHOLD``, 15%; H200, 8 queues: ResNet-50 0.96
  against the CUDA decoder's 0.984; under CUDA graphs 0.81 against 0.92-0.94; ResNet-18, which the CUDA
  decoder starves, 0.85 against 0.60);
- on the hardware decoder, past the batches the old pipeline had queued and ``SKIP`` more, a trial of
  ``WINDOW`` batches (added up over iterations, each one's first ``SKIP`` left out): handed out more
  slowly than in the window that moved it (on few queues: clearly more slowly, under 0.95 of it,
  ``FEW_QUEUES_KEEP``), the loader moves back to the CUDA decoder. Either way the choice is then final.
  A move back costs its one-offs again (a rebuild and the CUDA pipeline's first batch, seconds), so on few
  queues a trial near the rate before it keeps the move: H100, 8 queues, ResNet-18 (2026-12-06), four moves,
  kept at 11-12% faster scored 0.82-0.83 of the ceiling, taken back at 6% faster and 1% slower under the
  earlier margin (kept only if 10% faster) 0.51-0.56, and the hardware decoder from the start 0.83 there.
  That margin dated from a wrong keep (6% faster) under CUDA graphs, where a move on few queues now goes to a
  small share only (below). Measured on
  the H200 with the earlier bar and judge (2% / 10%, no margin; ``cuda_graphs_trial`` and
  ``fast_model_probe`` in the earlier ceiling.json that git keeps): under CUDA graphs that judge moved every
  time and the trial took the move back in 4 of 5 rows, at one-off costs (the hardware decoder's first batch
  1.7-3 s, the CUDA pipeline's first batch after a move back ~5 s). With this judge and the bars before the
  CUDA-graphs one (the run of record): no move under CUDA graphs (3.5% starved; 0.894, the hand loop 0.793), a
  kept move with ResNet-18 (0.691 against 0.638).

``None`` (the default) is the loader's own choice by CUDA's hardware queues: with fewer than 32
(``CUDA_DEVICE_MAX_CONNECTIONS`` unset or smaller) and the cores for it, the CUDA decoder alone, moving
to the hardware decoder as ``"auto"`` does if that starves the loop (a fast model), for ``FEW_QUEUES_LOAD``;
else ``HARDWARE_LOAD`` throughout (too few cores for the Huffman stage, or wide queues). Measured on an H200
(ResNet-50, 8 queues, a loop that runs ahead of the GPU): the hardware decoder's streams stall behind one another
there (0.92-0.93 of the data-free ceiling, 0.96 with :class:`~datapipe.device.queues.StepHold`), the CUDA decoder
with 12 threads does not (0.984, no hold; the hand-written DALI loop 0.90-0.94); with 32 queues the hardware
decoder gives 0.985. The CUDA decoder's Huffman stage is CPU-bound: 8 threads capped it at ~5.4k images/s under
ResNet-50 with ``torch.compile`` (which wants ~6.7k: 0.80 of its ceiling), 12 threads reach 6.5k there (0.977; the
hand loop 0.905). A move on few queues goes to half the batch (``FEW_QUEUES_LOAD``), not ``HARDWARE_LOAD``: H100,
8 queues, ResNet-18 eager with the hold, 8 threads, each share set from the start (2026-12-06, 2 rounds each):
0.4: 0.884-0.891, 0.5: 0.876-0.883, 0.6: 0.869-0.900, 0.75: 0.808-0.818, 0.9: 0.807-0.809; the move to 0.75
0.812-0.833, the hand DALI loop 0.794-0.798.

Under CUDA graphs (``torch.compile(mode="reduce-overhead")``, read from the consumer's thread once a window on few
queues starves more than ``GRAPHS_THRESHOLD``: :func:`datapipe.device.step_kind.step_kind`), the bar is that lower
one (the CUDA decoder starves a graphs step 2.8-3.3% there), judged without the window's largest wait (a shortfall
that lasts, not one stall), and the move goes to a tenth of the batch (``GRAPHS_LOAD``, ``why``: ``"cuda_graphs"``),
with the hold: the CUDA decoder keeps most of the work and the hardware decoder adds the rate it
lacks. H100, 8 queues, ResNet-50, each set from the start (2026-12-06, 2 rounds): share 0.05: 0.953-0.954, 0.1:
0.954-0.959 (3 rows), 0.15: 0.952-0.953, 0.2: 0.947, 0.3: 0.921-0.925; 0.1 without the hold 0.929; the CUDA
decoder alone 0.931-0.938; the hand DALI loop 0.849-0.850. All of the batch on the hardware decoder measured
slower than the CUDA decoder every time (0.819 with the hold; H200 earlier 0.81 against 0.92-0.94), so the loader
used to settle on the CUDA decoder there. The step counts as CUDA graphs only if a graph ran after the judging
window began (``step_kind(since=...)``): a graph tree an earlier model left in the thread does not (H100,
2026-12-06: an eager ResNet-18 after CUDA-graph rows in one process read that way, 0.59 against 0.84 moved).
Either way, a loop seen starving on few queues gets one warning per process naming ``CUDA_DEVICE_MAX_CONNECTIONS=32``
(:func:`advise_wide_queues`): there the hardware decoder keeps up without stalling (0.982 under CUDA graphs,
0.950 with ResNet-18 on an H100), and the variable only works if set before CUDA starts, which the library cannot
do for the user.

The switch rebuilds DALI's pipeline where the last one stopped (the readers do it, losing and
repeating nothing; about 0.3 s). Few cores
(fewer than ``MIN_CORES`` for this process) start on the hardware decoder. The images the two
decoders make differ in their low bits: pass a number for bit-identical reruns.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

log = logging.getLogger("loaders.images")

HARDWARE_LOAD = 0.75  # the hardware decoder's share where it runs throughout (wide queues, few cores)
FEW_QUEUES_LOAD = 0.5  # a move's share on few queues, eager or compiled step (ResNet-18: 0.88 against 0.81 at 0.75)
GRAPHS_LOAD = 0.1  # a move's share on few queues under CUDA graphs (0.954-0.959 against the CUDA decoder's 0.93-0.94)
GRAPHS_THRESHOLD = 0.02  # starved share that moves a CUDA-graphs step on few queues (its CUDA decoder: 2.8-3.3%)
CUDA_THREADS = 12  # DALI threads for the CUDA decoder's Huffman stage (compiled ResNet-50: 8 gave 5.4k img/s, 12 6.5k)
SPARE_CORES = 4  # left to the training loop's threads (Python, autograd) and the producer: threads <= cores - 4
MIN_CORES = 12  # fewer cores for this process: the hardware decoder from the start
SKIP = 5
WINDOW = 30
EARLY = 8
THRESHOLD = 0.02  # starved share of the time that moves to the hardware decoder, on wide queues (it costs nothing)
EARLY_THRESHOLD = 0.10
FEW_QUEUES_THRESHOLD = 0.15  # on few queues the hardware decoder costs the step itself 2-14% (see the module)
FEW_QUEUES_EARLY_THRESHOLD = 0.30
FEW_QUEUES_KEEP = 0.95  # on few queues a move is taken back only if the trial is clearly slower (see the module)


def cores_per_process() -> int:
    """Cores this process may use, shared with the other processes of the host (``LOCAL_WORLD_SIZE``)."""
    from datapipe.device.autotune import usable_cores

    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(usable_cores(), (os.cpu_count() or 1) // local))


def _queues() -> int:
    from datapipe.device.queues import hardware_queues

    return hardware_queues()


def _few_queues(queues: int | None) -> bool:
    """Fewer CUDA hardware queues than the hardware decoder needs to run beside the step without slowing it."""
    from datapipe.device.queues import WIDE_QUEUES

    return (_queues() if queues is None else queues) < WIDE_QUEUES


class DecoderChoice:
    """The decoder share and DALI thread count the next pipeline is built with, and when to change them.

    ``setting``: ``None`` (the loader's choice, see the module), ``"auto"`` or a fixed share in [0, 1].
    ``threads``: the user's ``num_threads`` (None: ``CUDA_THREADS``, at most ``cores - SPARE_CORES``, while
    a CUDA pipeline decodes on the CUDA decoder alone; ``hardware_threads`` otherwise). A CPU pipeline's
    share reads 0.0 for ``None`` and ``"auto"`` (no GPU decoder runs). Only a ``switchable`` choice (``"auto"``,
    or ``None``'s CUDA decoder) ever changes: the consumer reports each batch (:meth:`took`); the producer
    checks :attr:`due` between batches, calls :meth:`switching`, builds its new pipeline and calls
    :meth:`switched`.
    """

    def __init__(self, setting: float | str | None, *, cuda: bool, threads: int | None, hardware_threads: int,
                 cores: int | None = None, queues: int | None = None, step_kind: Callable[[], str] | None = None):
        cores = cores_per_process() if cores is None else cores
        self.auto = setting == "auto" and cuda
        self.threads_asked = threads
        self.hardware_threads = hardware_threads
        self.cuda_threads = max(1, min(CUDA_THREADS, cores - SPARE_CORES))
        self.cuda = cuda
        self.switchable = self.auto  # may move to the hardware decoder once (see the module)
        few_queues = cuda and _few_queues(queues)
        self.few_queues = few_queues
        self._step_kind = step_kind  # (consumer's thread) the step it runs; None: read torch's state
        self.threshold = FEW_QUEUES_THRESHOLD if few_queues else THRESHOLD
        self.early_threshold = FEW_QUEUES_EARLY_THRESHOLD if few_queues else EARLY_THRESHOLD
        self.keep = FEW_QUEUES_KEEP if few_queues else 1.0  # the trial's rate / the window's that moved it, to keep
        self.target = HARDWARE_LOAD  # the share a move goes to (set when it is decided)
        # why: "cpu" (no GPU decoder), "set" (a share the user gave), "few_queues" (the CUDA decoder: the hardware
        # decoder stalls beside training), "wide_queues" (the hardware decoder runs beside it), "few_cores",
        # "cuda_graphs" (later: the step runs CUDA graphs on few queues, so the move takes GRAPHS_LOAD)
        if not cuda:  # a CPU pipeline: no GPU decoder at all (a share the user gave is kept, unused)
            self.load = 0.0 if setting in (None, "auto") else float(setting)
            self.why = "cpu"
        elif setting is None:
            self.load = 0.0 if few_queues and cores >= MIN_CORES else HARDWARE_LOAD
            self.switchable = self.load == 0.0  # the CUDA decoder it chose, unless that starves the loop
            self.why = "wide_queues" if not few_queues else "few_queues" if self.switchable else "few_cores"
        elif self.auto and cores >= MIN_CORES:
            self.load = 0.0
            self.why = "set"
        else:
            self.load = HARDWARE_LOAD if setting == "auto" else float(setting)
            self.switchable = False  # already on the hardware decoder (too few cores), or a share the user gave
            self.why = "few_cores" if self.auto else "set"
        self.queues = (queues if queues is not None else _queues()) if cuda else None
        self.due = False  # set by the consumer: the producer should switch before its next batch
        self.settled = False  # the move was tried (kept or taken back): no more judging
        self.switched_after: int | None = None  # batches handed out when the switch was asked for
        self.switches = 0  # pipelines rebuilt for a switch
        self.rebuild_s = 0.0  # the producer's time spent rebuilding them
        self.rates: list[float] = []  # batches/s of the window that moved it, then of the trial window
        self.handed = 0
        self.starved: float | None = None  # the starved share of the last window judged on the CUDA decoder
        self._reset(SKIP)

    @property
    def threads(self) -> int:
        """DALI threads for the next pipeline."""
        if self.threads_asked is not None:
            return self.threads_asked
        return self.cuda_threads if self.cuda and self.load == 0.0 else self.hardware_threads

    def _reset(self, skip: int) -> None:
        self._skip = skip  # batches not judged from now on
        self._window_start: float | None = None  # the clock when judging started in this iteration
        self._graphs_mark: tuple | None = None  # the consumer thread's CUDA graph trees then (few queues)
        self._kind: str | None = None  # the step read in this window (few queues, once it starves over 2%)
        self._max_wait = 0.0  # the window's largest starved wait
        self._last = 0.0  # the clock at the last batch
        self._done_s = 0.0  # a trial's judged seconds in earlier iterations
        self._batches = 0
        self._wait = 0.0

    def start(self) -> None:
        """A new iteration: skip its first batches, then judge in windows. A trial goes on where it was (its
        batches and judged time add up over iterations), so a short epoch cannot keep it from ending."""
        if not self.on_trial:
            self._reset(SKIP)
            return
        if self._window_start is not None:
            self._done_s += self._last - self._window_start
        self._skip, self._window_start = SKIP, None

    @property
    def on_trial(self) -> bool:
        """Moved to the hardware decoder, and not yet settled on it or back."""
        return self.switchable and self.load > 0 and not self.settled

    @property
    def judging(self) -> bool:
        """Whether the consumer's batches are judged now: a switchable choice not yet settled, no switch due."""
        return self.switchable and not self.settled and not self.due

    @property
    def watching_starvation(self) -> bool:
        """Whether ``next()``'s waits are judged as starvation now (on the CUDA decoder, before any move)."""
        return self.judging and self.load == 0.0

    def took(self, starved_s: float, now: float) -> None:
        """(Consumer) a batch was handed out after ``starved_s`` blocked in ``next()`` with nothing queued on the
        GPU (0 for a wait while the GPU still worked); ``now``: the clock after it."""
        self.handed += 1
        if not self.judging:
            return
        self._last = now
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._window_start = now
                self._graphs_mark = self._mark()
            return
        self._batches += 1
        self._wait += starved_s
        self._max_wait = max(self._max_wait, starved_s)
        elapsed = self._done_s + now - self._window_start
        if elapsed <= 0:
            return
        if self.load > 0:  # the trial on the hardware decoder
            if self._batches >= WINDOW:
                self.rates.append(self._batches / elapsed)
                self.settled = True
                # slower than before (on few queues: clearly slower): back to the CUDA decoder
                self.due = self.rates[-1] < self.keep * self.rates[0]
            return
        starving = self._wait / elapsed
        self.starved = starving
        share, threshold, early_threshold = starving, self.threshold, self.early_threshold
        graphs = self._graphs(starving)
        if graphs:  # a shortfall that lasts, not one stall: the window's largest wait left out
            share = (self._wait - self._max_wait) / elapsed
            threshold = early_threshold = GRAPHS_THRESHOLD
        early = self._batches >= EARLY and share > early_threshold
        if share > threshold and (self._batches >= WINDOW or early):
            if self.few_queues:
                advise_wide_queues(starving, self._kind or self._step(), self.queues)
            if graphs:  # on few queues a small share with the hold beats both decoders alone there (module)
                self.target, self.why = GRAPHS_LOAD, "cuda_graphs"
            elif self.few_queues:
                self.target = FEW_QUEUES_LOAD
            self.due = True
            self.switched_after = self.handed
            self.rates.append(self._batches / elapsed)
        elif self._batches >= WINDOW:
            self._window_start, self._batches, self._wait, self._max_wait = now, 0, 0.0, 0.0
            self._graphs_mark, self._kind = self._mark(), None

    def _graphs(self, starving: float) -> bool:
        """(Few queues) whether the step runs CUDA graphs, read once a window, once ``EARLY`` batches are in and the
        loop starves more than ``GRAPHS_THRESHOLD`` (where a CUDA-graphs step could move; an eager or compiled one
        is read too, and moves only at its own bar)."""
        if self.few_queues and self._kind is None and self._batches >= EARLY and starving > GRAPHS_THRESHOLD:
            self._kind = self._step()
        return self._kind == "CUDA graphs"

    def _mark(self) -> tuple | None:
        """(Consumer's thread, on few queues) where its CUDA graph trees stand as a window starts: the step read at
        a move counts as CUDA graphs only if a graph ran since (not one an earlier model left behind)."""
        if not self.few_queues or self._step_kind is not None:
            return None
        from datapipe.device.step_kind import graph_marks

        return graph_marks()

    def _step(self) -> str:
        if self._step_kind is not None:
            return self._step_kind()
        from datapipe.device.step_kind import step_kind

        return step_kind(since=self._graphs_mark)

    def switching(self, in_flight: int = 0) -> None:
        """(Producer) the next pipeline decodes with the other decoder (call before building it): the hardware
        decoder for :attr:`target` on a move, the CUDA decoder alone when the trial takes it back.
        ``in_flight``: batches the old pipeline made that the consumer has yet to take (not judged either)."""
        self.load = 0.0 if self.load > 0 else self.target
        self._reset(SKIP + in_flight)  # the trial skips them and the new pipeline's first batches
        self.due = False  # last: the consumer judges again only once the window is reset

    def switched(self, seconds: float) -> None:
        """(Producer) the new pipeline is built; building it took ``seconds``."""
        self.switches += 1
        self.rebuild_s += seconds

    def stats(self) -> dict:
        """The share and threads in use, whether and when it moved, and the rates before the move and in its trial
        (``ImageLoader.stats()["decoder"]``; two switches: the trial took the move back)."""
        return {"hw_decoder_load": self.load, "auto": self.auto, "switchable": self.switchable, "settled": self.settled,
                "threads": self.threads,
                "switched_after_batches": self.switched_after, "switches": self.switches,
                "rebuild_s": round(self.rebuild_s, 3), "batches_per_s": [round(r, 2) for r in self.rates],
                "trial": self.trial, "starved": None if self.starved is None else round(self.starved, 4),
                "threshold": self.threshold, "graphs_threshold": GRAPHS_THRESHOLD if self.few_queues else None,
                "why": self.why, "queues": self.queues}

    @property
    def trial(self) -> str | None:
        """None (never moved), "on", "kept", "moving back" (decided, not yet rebuilt) or "taken back"."""
        if not self.rates:
            return None
        if not self.settled:
            return "on"
        if self.due:
            return "moving back"
        return "kept" if self.load > 0 else "taken back"


_ADVISED: list = []  # once per process


def advise_wide_queues(starving: float, step: str | None, queues: int | None) -> bool:
    """One warning per process when the loop starves on few hardware queues: what 32 would give (H100,
    2026-12-06: under CUDA graphs 0.920 -> 0.982 of the data-free ceiling, ResNet-18 0.84 -> 0.950). Returns
    whether it warned."""
    if _ADVISED:
        return False
    _ADVISED.append(starving)
    log.warning("ImageLoader: the training loop's GPU idled %.0f%% of the last window for want of a batch (%s step, "
                "%s CUDA hardware queues). The GPU's hardware JPEG decoder would keep up, but it stalls beside training "
                "on few queues: start the program with CUDA_DEVICE_MAX_CONNECTIONS=32 (set before CUDA starts; "
                "measured: CUDA graphs 0.92 -> 0.98 of the data-free ceiling, ResNet-18 0.84 -> 0.95; "
                "docs/performance.md)", 100 * starving, step or "this", queues or 8)
    return True


def age_replaced(replaced: list) -> list:
    """At an iteration's start: the ``[pipeline, iterations left]`` pairs replaced by a switch, one iteration older.

    A replaced pipeline is kept two iterations: batches it made may still be in the training
    loop's hands (they share its output memory) when the next iteration starts.
    """
    return [[pipe, left - 1] for pipe, left in replaced if left > 1]
