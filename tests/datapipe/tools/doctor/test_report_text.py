"""The doctor's one line on ImageLoader's decoder: the step it saw, the choice and why."""
from datapipe.tools.doctor.report_text import _decoder


def test_the_decoder_line_says_the_step_the_choice_and_why():
    chosen = {"hw_decoder_load": 0.0, "switchable": True, "threads": 12, "trial": None, "starved": 0.012,
              "threshold": 0.15, "why": "few_queues", "queues": 8}
    line = _decoder("ImageLoader", chosen, None, "CUDA graphs")
    assert line.startswith("  decoder: ImageLoader 0% of JPEGs on the hardware decoder, 12 DALI threads; ")
    assert "its GPU idled 1.2% of the last window for want of a batch; the move needs over 15%" in line  # no 2nd bar
    assert "its GPU idled 1.2% of the last window for want of a batch; the move needs over 2%" in _decoder(
        "ImageLoader", {**chosen, "graphs_threshold": 0.02}, None, "CUDA graphs")  # a graphs step's bar
    assert "the move needs over 15%" in _decoder("ImageLoader", {**chosen, "graphs_threshold": 0.02}, None, "eager")
    assert "; step: CUDA graphs;" in line
    assert "why: nvJPEG's CUDA decoder, since with 8 hardware queues the hardware decoder stalls" in line
    assert "\n" not in line
    wide = {**chosen, "hw_decoder_load": 0.75, "switchable": False, "threads": 8, "why": "wide_queues", "queues": 32}
    assert "why: 32 hardware queues let the hardware decoder run beside the step" in _decoder("ImageLoader", wide,
                                                                                              "32", "eager")
    assert "why: the decoder share you set" in _decoder("ImageLoader", {**wide, "why": "set"}, "32", "compiled")
    graphs = {**chosen, "hw_decoder_load": 0.1, "threads": 8, "why": "cuda_graphs", "settled": True,
              "switched_after_batches": 13, "batches_per_s": [20.5, 21.0], "trial": "kept"}
    line = _decoder("ImageLoader", graphs, None, "CUDA graphs")
    assert line.startswith("  decoder: ImageLoader 10% of JPEGs on the hardware decoder, 8 DALI threads; ")
    assert "moves there by itself" not in line and "kept it" in line
    assert "why: a CUDA-graphs step on 8 hardware queues: the CUDA decoder keeps most of each batch" in line
