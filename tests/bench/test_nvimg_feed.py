"""bench/nvimg_feed.py's host-side parts: crop boxes, the batched resize, its options and the shard reader."""
import io
import random
import tarfile

import pytest
import torch
import torch.nn.functional as F

from bench.nvimg_feed import nvimg_options, random_crop, read_samples, resize_batch


def gradient(h: int, w: int) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 255 // (h + w)], -1).to(torch.uint8)


def test_random_crop_boxes_lie_inside_the_image():
    rng = random.Random(0)
    for _ in range(500):
        y0, x0, h, w = random_crop(rng, 375, 500)
        assert 0 <= y0 and y0 + h <= 375 and 0 <= x0 and x0 + w <= 500 and h > 0 and w > 0
        assert 0.07 * 375 * 500 <= h * w <= 375 * 500


def test_resize_batch_matches_a_crop_then_an_antialiased_resize():
    img = gradient(375, 500)
    small = gradient(300, 400)
    out = resize_batch([img, small], [(100, 50, 200, 300), (0, 0, 300, 400)], 56)
    assert out.shape == (2, 3, 56, 56) and out.dtype == torch.float32
    crop = img[100:300, 50:350].permute(2, 0, 1)[None].float()
    ref = F.interpolate(crop, size=(56, 56), mode="bilinear", antialias=True, align_corners=False)[0]
    assert (out[0] - ref).abs().mean() < 0.5
    ref2 = F.interpolate(small.permute(2, 0, 1)[None].float(), size=(56, 56), mode="bilinear", antialias=True)[0]
    assert (out[1] - ref2).abs().mean() < 0.5  # the smaller image padded into the batch: its box alone is read


def test_options_parse_and_refuse_unknown_ones():
    assert nvimg_options("gpu+hw0.5+prio0+q4") == {"gpu": True, "hw": 0.5, "prio0": True, "depth": 4}
    assert nvimg_options("") == {}
    with pytest.raises(ValueError, match="unknown option"):
        nvimg_options("fast")


def test_read_samples_pairs_jpegs_with_labels(tmp_path):
    path = tmp_path / "shard-000000.tar"
    with tarfile.open(path, "w") as tar:
        for key, parts in (("a", {"jpg": b"J1", "cls": b"3"}), ("b", {"jpeg": b"J2", "cls": b"7"}),
                           ("c", {"cls": b"9"})):
            for ext, data in parts.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    jpegs, labels = read_samples([str(path)])
    assert sorted(zip(jpegs, labels)) == [(b"J1", 3), (b"J2", 7)]
    with pytest.raises(ValueError, match="no .jpg"):
        read_samples([])


def test_the_stream_option_reads_every_sample_of_an_epoch_once_in_full_batches(tmp_path):
    from bench.nvimg_feed import NvImgFeed
    from datapipe.tools.synthetic import make_image_dataset

    info = make_image_dataset(str(tmp_path / "images"), num_images=40, num_classes=5, size=(20, 16),
                              shard_max_count=8, progress=False)
    feed = object.__new__(NvImgFeed)  # the reading half alone: no decoder, no CUDA
    feed.urls, feed.from_stream, feed.batch_size, feed.seed = info["shards"], True, 8, 0
    batches = feed._encoded(random.Random(0))
    first_epoch = [next(batches) for _ in range(5)]
    assert all(len(enc) == 8 and len(labels) == 8 for enc, labels in first_epoch)
    jpegs = [bytes(a) for enc, _ in first_epoch for a in enc]
    assert len(set(jpegs)) == 40 and all(j[:2] == b"\xff\xd8" for j in jpegs)  # each image once, JPEG bytes
    assert all(0 <= label < 5 for _, labels in first_epoch for label in labels)
    more = next(batches)  # epochs go on without end
    assert len(more[0]) == 8
    batches.close()
