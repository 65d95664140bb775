"""hw_decoder_load: None (the loader's choice by the hardware queues); "auto": the CUDA decoder while the consumer
does not wait, the hardware decoder once it does."""
import pytest

from loaders.images import decoder_choice
from loaders.images.decoder_choice import (EARLY, FEW_QUEUES_LOAD, GRAPHS_LOAD, HARDWARE_LOAD, SKIP, THRESHOLD, WINDOW,
                                           DecoderChoice)


@pytest.fixture(autouse=True)
def eager_step(monkeypatch):
    """The step these tests judge is eager unless a test says otherwise (a CUDA graph run earlier in the process
    would otherwise change what the choice reads)."""
    monkeypatch.setattr("datapipe.device.step_kind.step_kind", lambda modules=None, since=None: "eager")
    monkeypatch.setattr(decoder_choice, "_ADVISED", [])  # each test sees the once-per-process warning afresh


def auto(cores=16, threads=None, cuda=True, queues=32):
    """An "auto" choice; on wide hardware queues (32) unless told: the hardware decoder costs the step nothing."""
    return DecoderChoice("auto", cuda=cuda, threads=threads, hardware_threads=8, cores=cores, queues=queues)


def feed(choice, batches, *, step_s=0.05, wait_s=0.0, t0=0.0):
    """The consumer takes ``batches`` batches, each ``step_s`` of work after ``wait_s`` blocked in next()."""
    now = t0
    for _ in range(batches):
        now += wait_s
        choice.took(wait_s, now)
        now += step_s
        if choice.due:
            break
    return now


def test_auto_starts_on_the_cuda_decoder_with_its_threads_where_cores_allow():
    c = auto()
    assert c.load == 0.0 and c.threads == decoder_choice.CUDA_THREADS and c.auto
    assert auto(threads=6).threads == 6  # the user's num_threads wins
    assert auto(cores=decoder_choice.MIN_CORES).threads == decoder_choice.MIN_CORES - decoder_choice.SPARE_CORES
    few = auto(cores=decoder_choice.MIN_CORES - 1)  # too few cores: the hardware decoder from the start
    assert few.load == HARDWARE_LOAD and few.threads == 8
    feed(few, 200, wait_s=0.05)
    assert not few.due


@pytest.mark.parametrize("queues, cores, cuda, load", [
    (8, 16, True, 0.0), (31, 12, True, 0.0),  # few queues: the CUDA decoder, where the cores allow
    (32, 16, True, HARDWARE_LOAD),  # wide queues: the hardware decoder
    (8, 11, True, HARDWARE_LOAD),  # too few cores for the CUDA decoder's Huffman stage
    (8, 16, False, 0.0)])  # a CPU pipeline: no GPU decoder runs
def test_the_default_share_follows_the_hardware_queues(queues, cores, cuda, load):
    c = DecoderChoice(None, cuda=cuda, threads=None, hardware_threads=8, cores=cores, queues=queues)
    cuda_threads = min(decoder_choice.CUDA_THREADS, cores - decoder_choice.SPARE_CORES)
    assert c.load == load and not c.auto and c.threads == (cuda_threads if load == 0.0 and cuda else 8)
    assert DecoderChoice(None, cuda=cuda, threads=5, hardware_threads=8, cores=cores, queues=queues).threads == 5
    assert c.switchable is (load == 0.0 and cuda)  # only the CUDA decoder it chose may give way
    feed(c, 20 * WINDOW, wait_s=0.0)  # a loop that is never starved (waits while the GPU still works count 0)
    assert not c.due
    feed(c, 500, wait_s=0.05)  # a starved loop: the CUDA decoder gives way to the hardware decoder, on trial
    assert c.due is c.switchable
    if c.due:
        c.switching()
        moved_to = FEW_QUEUES_LOAD if queues < 32 else HARDWARE_LOAD  # few queues: half the batch (module)
        assert c.load == moved_to and c.threads == 8 and c.judging and not c.settled  # on trial


def test_the_default_share_reads_cuda_device_max_connections(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16).load == HARDWARE_LOAD
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16).load == 0.0


def test_fixed_shares_and_cpu_pipelines_never_switch():
    for choice in (DecoderChoice(0.0, cuda=True, threads=None, hardware_threads=8, cores=16),
                   DecoderChoice(0.3, cuda=True, threads=None, hardware_threads=8, cores=16), auto(cuda=False)):
        feed(choice, 500, wait_s=0.05)
        assert not choice.due and choice.switched_after is None
    assert auto(cuda=False).load == 0.0  # "auto" on a CPU pipeline: no GPU decoder runs
    assert DecoderChoice(0.3, cuda=False, threads=None, hardware_threads=8, cores=16).load == 0.3  # kept, unused
    fixed = DecoderChoice(0.0, cuda=True, threads=None, hardware_threads=8, cores=16)
    assert fixed.threads == decoder_choice.CUDA_THREADS  # the CUDA decoder alone: its threads


def test_a_consumer_that_does_not_wait_keeps_the_cuda_decoder():
    c = auto()
    feed(c, 20 * WINDOW, wait_s=0.05 * 0.004)  # 0.4% waits: the handoff's usual cost
    assert not c.due and c.load == 0.0


def test_a_steady_shortfall_switches_at_the_end_of_a_window():
    c = auto()
    feed(c, 10 * WINDOW, wait_s=0.05 * 0.05)  # 5% waits: above THRESHOLD, below EARLY_THRESHOLD
    assert c.due and c.switched_after == SKIP + WINDOW
    c.switching()
    assert c.load == HARDWARE_LOAD and c.threads == 8 and not c.due
    c.switched(2.5)
    stats = c.stats()
    assert stats.pop("batches_per_s") == [pytest.approx(1 / 0.0525, abs=0.01)]  # the window that moved it
    assert stats.pop("starved") == pytest.approx(0.05 * 0.05 / 0.0525, abs=1e-3)  # the share that moved it
    assert stats == {"hw_decoder_load": HARDWARE_LOAD, "auto": True, "switchable": True, "settled": False,
                     "threads": 8, "switched_after_batches": SKIP + WINDOW, "switches": 1, "rebuild_s": 2.5, "trial": "on",
                     "threshold": THRESHOLD, "graphs_threshold": None, "why": "set", "queues": 32}


def moved(wait_before: float) -> DecoderChoice:
    """An "auto" choice that moved to the hardware decoder after waits of ``wait_before`` per 50 ms step."""
    c = auto()
    feed(c, 10 * WINDOW, wait_s=wait_before)
    assert c.due
    c.switching()
    c.switched(0.5)
    return c


def test_the_move_is_kept_when_the_loop_runs_faster_on_the_hardware_decoder():
    c = moved(0.05 * 0.05)
    feed(c, SKIP + WINDOW, wait_s=0.0)  # the trial: no waits, faster
    assert c.settled and not c.due and c.load == HARDWARE_LOAD and c.trial == "kept"
    assert c.stats()["batches_per_s"][1] > c.stats()["batches_per_s"][0]
    feed(c, 10 * WINDOW, wait_s=0.05)  # starving again: settled, no more moves
    assert not c.due and c.load == HARDWARE_LOAD and c.switches == 1


def test_the_move_is_taken_back_when_the_loop_runs_slower_on_the_hardware_decoder():
    c = moved(0.05 * 0.05)
    feed(c, SKIP + WINDOW, wait_s=0.05)  # the trial: half the time waiting, slower than before
    assert c.settled and c.due and c.trial == "moving back"
    c.switching()
    c.switched(0.5)
    assert c.trial == "taken back"
    assert c.load == 0.0 and c.threads == decoder_choice.CUDA_THREADS and not c.due and c.switches == 2
    feed(c, 10 * WINDOW, wait_s=0.05)
    assert not c.due and c.load == 0.0  # final


def test_a_trial_goes_on_over_short_epochs():
    c = moved(0.05 * 0.05)
    now = 0.0
    for epoch in range(WINDOW):  # epochs of SKIP + 3 batches: each alone too short for a trial window
        c.start()
        now = feed(c, SKIP, wait_s=0.5, t0=now + 10.0)  # each epoch's slow start and the gap between epochs
        now = feed(c, 3, wait_s=0.0, t0=now)  # unjudged
        if c.settled:
            break
    assert c.trial == "kept" and epoch * 3 < WINDOW + 3  # judged on its 3 batches an epoch, gaps left out


def test_batches_the_old_pipeline_queued_are_not_judged_in_the_trial():
    c = auto()
    feed(c, 10 * WINDOW, wait_s=0.05 * 0.05)
    c.switching(in_flight=4)
    now = feed(c, SKIP + 4, wait_s=1.0)  # four old batches, then the new pipeline's slow start
    feed(c, WINDOW, wait_s=0.0, t0=now)
    assert c.trial == "kept"


def test_auto_without_the_cores_for_the_cuda_decoder_has_nothing_to_try():
    c = auto(cores=8)
    assert c.load == HARDWARE_LOAD and not c.switchable and not c.judging
    feed(c, 10 * WINDOW, wait_s=0.05)
    assert c.trial is None and not c.due


def test_the_trial_skips_the_new_pipelines_first_batches():
    c = moved(0.05 * 0.05)
    now = feed(c, SKIP, wait_s=1.0)  # the rebuilt pipeline's slow start is not held against it
    feed(c, WINDOW, wait_s=0.0, t0=now)
    assert c.settled and not c.due and c.load == HARDWARE_LOAD


@pytest.mark.parametrize("starved, moves_after", [
    (0.06, None),  # CUDA graphs on an H200: the CUDA decoder ~6% short, less than the hardware decoder costs
    (0.20, SKIP + WINDOW),  # more than it costs: moves at the window's end
    (0.40, SKIP + EARLY)])  # ResNet-18 on the CUDA decoder: at once
def test_few_queues_move_only_when_starved_more_than_the_hardware_decoder_costs(starved, moves_after):
    for c in (auto(queues=8), DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8)):
        assert c.threshold == decoder_choice.FEW_QUEUES_THRESHOLD
        feed(c, 10 * WINDOW, step_s=0.05 * (1 - starved), wait_s=0.05 * starved)
        assert c.due is (moves_after is not None) and c.switched_after == moves_after


def test_a_starving_consumer_switches_early():
    c = auto()
    feed(c, 10 * WINDOW, wait_s=0.05)  # half the time waiting
    assert c.due and c.switched_after == SKIP + EARLY


def test_each_iterations_first_batches_are_not_judged():
    c = auto()
    for epoch in range(5):
        c.start()
        now = feed(c, SKIP, wait_s=1.0, t0=epoch * 100.0)  # a slow start every epoch (pipeline, workers)
        feed(c, WINDOW, wait_s=0.0, t0=now)
    assert not c.due


@pytest.mark.parametrize("bad", ["fast", -0.1, 1.5])
def test_bad_settings_are_refused(bad):
    from loaders.images.options import DecodeOptions

    with pytest.raises(ValueError, match="hw_decoder_load"):
        DecodeOptions(hw_decoder_load=bad)


def test_a_replaced_pipeline_is_kept_two_iterations():
    from loaders.images.decoder_choice import age_replaced

    replaced = [["old", 2]]
    replaced = age_replaced(replaced)  # the next iteration: its batches may still be in the loop's hands
    assert replaced == [["old", 1]]
    assert age_replaced(replaced) == []


@pytest.mark.parametrize("queues, faster, kept", [
    (8, 1.06, True), (8, 0.99, True),  # few queues, ResNet-18 on an H100: near the rate before, a move back costs more
    (8, 0.90, False),  # few queues: clearly slower goes back
    (8, 1.30, True),  # ResNet-18 on the hardware decoder: 28-45% faster
    (32, 0.99, False), (32, 1.06, True)])  # wide queues: the hardware decoder costs nothing, any loss goes back
def test_on_few_queues_a_move_is_taken_back_only_when_clearly_slower(queues, faster, kept):
    c = auto(queues=queues)
    feed(c, 10 * WINDOW, step_s=0.025, wait_s=0.025)  # half the time starved: moves on any queues
    assert c.due
    c.switching()
    c.switched(0.3)
    feed(c, SKIP + WINDOW, step_s=0.05 / faster)
    assert c.settled and c.trial == ("kept" if kept else "moving back")
    assert c.stats()["batches_per_s"][1] == pytest.approx(faster * c.stats()["batches_per_s"][0], rel=1e-6)


@pytest.mark.parametrize("setting, queues, cores, cuda, why", [
    (None, 8, 16, True, "few_queues"), (None, 32, 16, True, "wide_queues"), (None, 8, 4, True, "few_cores"),
    ("auto", 8, 4, True, "few_cores"), ("auto", 8, 16, True, "set"), (0.3, 8, 16, True, "set"),
    (None, 8, 16, False, "cpu")])
def test_the_choice_says_why_it_was_made(setting, queues, cores, cuda, why):
    """What the doctor prints: the reason for the decoder the loader starts on, and the queues it went by."""
    c = DecoderChoice(setting, cuda=cuda, threads=None, hardware_threads=8, cores=cores, queues=queues)
    assert c.stats()["why"] == why
    assert c.stats()["queues"] == (queues if cuda else None)



@pytest.mark.parametrize("step, queues, moved_to", [
    ("CUDA graphs", 8, GRAPHS_LOAD),  # few queues: a tenth on the hardware decoder, with the hold (module)
    ("CUDA graphs", 32, HARDWARE_LOAD),  # on wide queues the hardware decoder runs beside the step (0.981)
    ("compiled", 8, FEW_QUEUES_LOAD),
    ("eager", 8, FEW_QUEUES_LOAD)])
def test_a_starved_loop_moves_to_the_share_its_step_and_queues_call_for(step, queues, moved_to):
    seen = []
    c = DecoderChoice("auto", cuda=True, threads=None, hardware_threads=8, cores=16, queues=queues,
                      step_kind=lambda: seen.append(1) or step)
    feed(c, 10 * WINDOW, step_s=0.03, wait_s=0.02)  # 40% starved: a move is due on any step
    assert c.due and c.load == 0.0 and c.switched_after == SKIP + EARLY
    assert (c.why == "cuda_graphs") is (moved_to == GRAPHS_LOAD)
    assert len(seen) == (1 if queues == 8 else 0)  # read once, as the move came in sight, and only on few queues
    c.switching()
    assert c.load == moved_to and c.on_trial
    c.switched(0.3)
    feed(c, SKIP + WINDOW, step_s=0.03, wait_s=0.0)  # the trial: faster, kept
    assert c.settled and c.trial == "kept" and c.load == moved_to


@pytest.mark.parametrize("step, moves", [("CUDA graphs", True), ("compiled", False), ("eager", False)])
def test_on_few_queues_a_graphs_step_moves_at_a_lower_bar(step, moves):
    """A CUDA-graphs step starved 3-4% of the time (the CUDA decoder's shortfall there) moves to the small share; an
    eager or compiled step starved as much stays on the CUDA decoder (its bar on few queues: 15%)."""
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8, step_kind=lambda: step)
    feed(c, 10 * WINDOW, step_s=0.05, wait_s=0.05 * 0.035)
    assert c.due is moves and c.load == 0.0
    assert c.stats()["threshold"] == decoder_choice.FEW_QUEUES_THRESHOLD  # an eager or compiled step's bar
    assert c.stats()["graphs_threshold"] == decoder_choice.GRAPHS_THRESHOLD  # a CUDA-graphs step's (the doctor picks)
    if moves:
        assert c.switched_after == SKIP + EARLY and c.why == "cuda_graphs"  # early: inside a usual warm-up
        c.switching()
        assert c.load == GRAPHS_LOAD and c.threads == 8
    else:
        assert c.why == "few_queues" and not c.settled and c.judging
    quiet = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8, step_kind=lambda: step)
    feed(quiet, 10 * WINDOW, step_s=0.05, wait_s=0.05 * 0.01)  # 1% starved: fed well enough on any step
    assert not quiet.due and quiet.load == 0.0
    assert DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=32).stats()[
        "graphs_threshold"] is None  # wide queues: one bar for every step


def test_one_stall_does_not_move_a_graphs_step():
    """A CUDA-graphs loop fed in time but for one 100 ms stall (a checkpoint, a slow read) stays: its bar is judged
    without the window's largest wait, so only a shortfall that lasts moves it."""
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8,
                      step_kind=lambda: "CUDA graphs")
    now = feed(c, SKIP + 3, step_s=0.05)
    c.took(0.1, now + 0.1)  # one stall, 4 batches into the window
    feed(c, 10 * WINDOW, step_s=0.05, t0=now + 0.15)
    assert not c.due and c.load == 0.0 and c.why == "few_queues"
    twice = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8,
                          step_kind=lambda: "CUDA graphs")
    now = feed(twice, SKIP + 3, step_s=0.05)
    twice.took(0.1, now + 0.1)
    twice.took(0.1, now + 0.25)  # a second stall in the same window: no longer one
    feed(twice, 10 * WINDOW, step_s=0.05, t0=now + 0.3)
    assert twice.due and twice.why == "cuda_graphs"


def test_a_new_iteration_reads_the_step_again():
    """The step read in one iteration is not carried into the next: a loop judged eager (5% starved, under its bar)
    that runs CUDA graphs from the next epoch on moves within that epoch's first window."""
    steps = ["eager"]
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8,
                      step_kind=lambda: steps[-1])
    now = feed(c, SKIP + EARLY + 2, step_s=0.05, wait_s=0.05 * 0.05)
    assert not c.due and c._kind == "eager"
    c.start()
    steps.append("CUDA graphs")
    before = c.handed
    feed(c, 10 * WINDOW, step_s=0.05, wait_s=0.05 * 0.05, t0=now)
    assert c.due and c.why == "cuda_graphs" and c.switched_after == before + SKIP + EARLY


def test_the_step_is_read_only_with_a_move_in_sight_and_once_a_window():
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8,
                      step_kind=lambda: pytest.fail("read without a move in sight"))
    feed(c, 10 * WINDOW, step_s=0.05)  # never waits
    assert not c.due and c.why == "few_queues"
    seen = []
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8,
                      step_kind=lambda: seen.append(1) or "eager")
    feed(c, SKIP + 4 * WINDOW, step_s=0.05, wait_s=0.05 * 0.05)  # 5% starved: under an eager step's bar
    assert not c.due and len(seen) == 4  # one read a window


def test_a_cuda_graph_tree_left_by_an_earlier_model_does_not_stop_a_move(monkeypatch):
    """A process that ran CUDA graphs before (another model, an evaluation) and now trains eager: the tree manager
    is still there, but no graph runs while the loader judges, so a starved loop moves (ResNet-18 on 8 queues
    read as CUDA graphs that way: 0.59 against 0.84 with the move)."""
    from datapipe.device import step_kind as sk

    manager = type("Manager", (), {"current_gen": 7})()
    monkeypatch.setattr(sk, "graph_marks", lambda modules=None: ((id(manager), manager.current_gen),))
    monkeypatch.setattr(sk, "step_kind", lambda modules=None, since=None: (
        "CUDA graphs" if since is None or sk.graph_marks() != since else "eager"))
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8)
    feed(c, 10 * WINDOW, step_s=0.03, wait_s=0.02)
    assert c.due and c.why == "few_queues"  # nothing ran since the window's mark: moves
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8)
    now = feed(c, SKIP + 2, step_s=0.03, wait_s=0.02)  # the window starts, its mark taken
    manager.current_gen = 8  # a graph replays while the loader judges
    feed(c, 10 * WINDOW, step_s=0.03, wait_s=0.02, t0=now)
    assert c.due and c.why == "cuda_graphs"  # a graph ran while judged: the graphs step's share
    c.switching()
    assert c.load == GRAPHS_LOAD


@pytest.mark.parametrize("step, queues, warns", [("CUDA graphs", 8, True), ("eager", 8, True), ("eager", 32, False)])
def test_a_starved_loop_on_few_queues_is_told_once_what_32_queues_give(caplog, step, queues, warns):
    caplog.set_level("WARNING", logger="loaders.images")
    for _ in range(2):  # a second loader in the process: no second warning
        c = DecoderChoice("auto", cuda=True, threads=None, hardware_threads=8, cores=16, queues=queues,
                          step_kind=lambda: step)
        feed(c, 10 * WINDOW, step_s=0.03, wait_s=0.02)
    said = [r.getMessage() for r in caplog.records if "CUDA_DEVICE_MAX_CONNECTIONS=32" in r.getMessage()]
    assert len(said) == (1 if warns else 0)
    if warns:
        assert f"({step} step, 8 CUDA hardware queues)" in said[0] and "idled 40%" in said[0]


def test_a_loop_that_does_not_starve_is_told_nothing(caplog):
    caplog.set_level("WARNING", logger="loaders.images")
    c = DecoderChoice(None, cuda=True, threads=None, hardware_threads=8, cores=16, queues=8, step_kind=lambda: "eager")
    feed(c, 10 * WINDOW, step_s=0.05)
    assert not [r for r in caplog.records if "CUDA_DEVICE_MAX_CONNECTIONS" in r.getMessage()]
