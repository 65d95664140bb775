"""datapipe.tools.bench.loader_stages: the per-stage rates and the stage that bounds the rest."""
import torch

from datapipe.tools.bench.loader_stages import bottleneck, consume


def test_the_slowest_timed_stage_bounds_the_rest():
    stages = [{"stage": "read", "samples_per_s": 9000.0}, {"stage": "decode", "samples_per_s": 300.0, "parallel": 4},
              {"stage": "collate", "samples_per_s": None}, {"stage": "augment", "samples_per_s": 600.0}]
    b = bottleneck(stages)
    assert b["stage"] == "decode" and b["samples_per_s"] == 300.0
    assert b["text"] == "300 samples/s with 4 workers, 2.0x below the next slowest (augment)"


def test_consume_reduces_the_first_tensor_of_a_batch():
    assert consume({"k": ["a"], "x": torch.ones(2, 3)}, "cpu").item() == 6.0
    assert consume({"k": ["a"]}, "cpu") is None
