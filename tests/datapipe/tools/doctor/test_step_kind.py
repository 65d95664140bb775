"""The doctor names the step it saw (eager, compiled, CUDA graphs) and, in one line, ImageLoader's decoder and why."""
from collections import Counter, defaultdict
from types import SimpleNamespace

from datapipe.tools.doctor.report_text import _decoder
from datapipe.tools.doctor.step_kind import step_kind


def fake_torch(initialized=True, devices=1):
    cuda = SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: devices)
    return SimpleNamespace(cuda=cuda)


def dynamo(graphs):
    counters = defaultdict(Counter)
    counters["stats"]["unique_graphs"] = graphs
    return SimpleNamespace(counters=counters)


def trees(manager):
    return SimpleNamespace(get_manager=lambda i, create_if_none_exists=True: manager)


def test_a_process_that_never_compiled_ran_eager():
    assert step_kind({}) == "eager"
    assert step_kind({"torch": fake_torch(), "torch._dynamo.utils": dynamo(0)}) == "eager"  # imported, unused


def test_graphs_captured_by_torch_compile_mean_compiled():
    assert step_kind({"torch": fake_torch(), "torch._dynamo.utils": dynamo(3)}) == "compiled"
    no_tree = {"torch": fake_torch(), "torch._dynamo.utils": dynamo(3), "torch._inductor.cudagraph_trees": trees(None)}
    assert step_kind(no_tree) == "compiled"  # mode "default": no CUDA graph tree


def test_a_cuda_graph_tree_means_cuda_graphs():
    mods = {"torch": fake_torch(), "torch._dynamo.utils": dynamo(3), "torch._inductor.cudagraph_trees": trees(object())}
    assert step_kind(mods) == "CUDA graphs"
    mods["torch"] = fake_torch(initialized=False)  # CUDA never started: no graph could have run
    assert step_kind(mods) == "compiled"


def test_the_decoder_line_says_the_step_the_choice_and_why():
    chosen = {"hw_decoder_load": 0.0, "switchable": True, "threads": 12, "trial": None, "starved": 0.012,
              "threshold": 0.15, "why": "few_queues", "queues": 8}
    line = _decoder("ImageLoader", chosen, None, "CUDA graphs")
    assert line.startswith("  decoder: ImageLoader 0% of JPEGs on the hardware decoder, 12 DALI threads; ")
    assert "its GPU idled 1.2% of the last window for want of a batch; the move needs over 15%" in line
    assert "; step: CUDA graphs;" in line
    assert "why: nvJPEG's CUDA decoder, since with 8 hardware queues the hardware decoder stalls" in line
    assert "\n" not in line
    wide = {**chosen, "hw_decoder_load": 0.75, "switchable": False, "threads": 8, "why": "wide_queues", "queues": 32}
    assert "why: 32 hardware queues let the hardware decoder run beside the step" in _decoder("ImageLoader", wide,
                                                                                              "32", "eager")
    assert "why: the decoder share you set" in _decoder("ImageLoader", {**wide, "why": "set"}, "32", "compiled")
