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


def test_the_decode_stage_leaves_out_images_pil_cannot_decode_and_says_so(tmp_path):
    import io

    from PIL import Image

    from datapipe import ShardWriter
    from datapipe.tools.bench.loader_stages import measure_stages

    good = io.BytesIO()
    Image.new("RGB", (16, 12), (1, 2, 3)).save(good, format="JPEG")
    with ShardWriter(str(tmp_path / "shard-%06d.tar"), max_count=100) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "jpg": b"\xff\xd8\xff\xe0" + bytes(64) if i == 3 else good.getvalue(),
                     "cls": b"0"})
    urls = [str(tmp_path / "shard-000000.tar")]
    cfg = {"workers": 1, "batch_size": 2, "image_size": 8, "device": "cpu"}
    stages = {s["stage"]: s for s in measure_stages(urls, kind="images", cfg=cfg, sample_bytes=100.0, seconds=0.05)}
    assert stages["decode"]["samples_per_s"] > 0  # an OSError from PIL ended the whole command before
    assert "1 of the first 8 images left out" in stages["decode"]["note"]
