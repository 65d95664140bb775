"""bench/nvimg_feed.py without a GPU: crop boxes and the batched resize, the batch's post-processing with a stand-in
decoder, the producer thread's shutdown and error paths, the shard reading of its stream option, how ceiling.py drives
the feed, and (where nvImageCodec's wheel imports) what the feed relies on of nvImageCodec itself.

Tests that began as a defect a review found say so in their docstring; each one failed before its mend.
"""
import contextlib
import io
import queue
import random
import tarfile
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from bench import nvimg_feed
from bench.nvimg_feed import MEAN, STD, NvImgFeed, nvimg_options, random_crop, read_samples, resize_batch



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


# ---- crop boxes ----------------------------------------------------------------------------------------------
def test_random_crop_follows_random_resized_crop_ranges_and_reaches_every_position():
    rng = random.Random(1)
    H, W = 375, 500
    fracs, aspects = [], []
    for _ in range(20000):
        y0, x0, h, w = random_crop(rng, H, W)
        assert 0 <= y0 <= H - h and 0 <= x0 <= W - w and h > 0 and w > 0
        fracs.append(h * w / (H * W))
        aspects.append(w / h)
    assert min(fracs) < 0.09 and max(fracs) > 0.97  # scale (0.08, 1.0)
    assert min(aspects) > 0.74 and max(aspects) < 1.35  # ratio (3/4, 4/3), up to rounding
    assert min(aspects) < 0.76 and max(aspects) > 1.31
    ends = {(y0, x0, y0 + h, x0 + w) for y0, x0, h, w in (random_crop(rng, 12, 12) for _ in range(20000))}
    assert any(b[0] == 0 for b in ends) and any(b[2] == 12 for b in ends)  # randint inclusive, as torchvision
    assert any(b[1] == 0 for b in ends) and any(b[3] == 12 for b in ends)


# ---- the batched resize ----------------------------------------------------------------------------------
def test_resize_batch_top_left_edges_are_clamped_not_padded():
    big = torch.full((375, 500, 3), 50, dtype=torch.uint8)
    small = torch.full((300, 400, 3), 200, dtype=torch.uint8)
    out = resize_batch([big, small], [(0, 0, 375, 500), (0, 0, 100, 100)], 224)
    assert torch.allclose(out[1], torch.full_like(out[1], 200.0), atol=1e-3)


def test_resize_batch_keeps_the_right_and_bottom_edge_of_a_smaller_image():
    """(A defect found in review.) A box touching the right/bottom edge of an image smaller than the batch's
    largest: the bilinear taps of the last output row/column reached into the zero padding (``padding_mode="border"``
    only clamps at the padded batch's edge). The synthetic set mixes portrait and landscape sizes, so every batch
    pads."""
    big = torch.full((375, 500, 3), 50, dtype=torch.uint8)
    small = torch.full((300, 400, 3), 200, dtype=torch.uint8)
    out = resize_batch([big, small], [(0, 0, 375, 500), (200, 300, 100, 100)], 224)
    alone = resize_batch([small], [(200, 300, 100, 100)], 224)
    assert torch.allclose(alone[0], torch.full_like(alone[0], 200.0), atol=1e-3)  # without padding: exact
    assert out[1].min().item() > 199.0, f"edge pixels read the padding: min {out[1].min().item():.1f}"


def test_resize_batch_box_mapping_is_exact_at_a_2x_downscale():
    """A 32x32 box to 16x16: the 2x grid lands on pixel centres, so the result is the box's 2x2 average exactly
    (any half-pixel slip in the affine map shows); a non-square box in a padded batch too."""
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (60, 80, 3), dtype=torch.uint8, generator=g)
    other = torch.randint(0, 256, (90, 70, 3), dtype=torch.uint8, generator=g)
    out = resize_batch([img, other], [(10, 20, 32, 32), (5, 6, 32, 32)], 16)
    for i, (t, (y0, x0, h, w)) in enumerate(((img, (10, 20, 32, 32)), (other, (5, 6, 32, 32)))):
        ref = F.avg_pool2d(t[y0:y0 + h, x0:x0 + w].permute(2, 0, 1)[None].float(), 2)[0]
        assert torch.allclose(out[i], ref, atol=1e-3)


# ---- the batch's post-processing with a stand-in decoder (CPU) ---------------------------------------------
class _FakeImage:
    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class _FakeNv:
    class CodeStream:
        def __init__(self, data):
            self.data = data
            self.height, self.width = data.shape[:2]

    class _Decoder:
        def __init__(self):
            self.calls = []

        def decode(self, streams, images=None, cuda_stream=0):
            self.calls.append(images)
            return [_FakeImage(cs.data) for cs in streams]


@pytest.fixture
def cpu_feed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    class _Event:
        def record(self, stream=None):
            self.recorded = stream

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    feed = object.__new__(NvImgFeed)
    feed.nv = _FakeNv
    feed.decoder = _FakeNv._Decoder()
    feed.stream = type("S", (), {"cuda_stream": 0})()
    feed.device = torch.device("cpu")
    feed.size = 8
    feed.mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    feed.std = torch.tensor(STD).view(1, 3, 1, 1)
    return feed


def test_batch_flips_horizontally_and_normalises_with_imagenet_mean_std_in_0_255(cpu_feed):
    ramp = torch.arange(8, dtype=torch.float32).mul(30).view(1, 8, 1).expand(8, 8, 3).to(torch.uint8).contiguous()
    encoded = [ramp] * 64
    rng = random.Random(0)
    probe = random.Random(0)
    boxes = [random_crop(probe, 8, 8) for _ in encoded]
    flips = [probe.random() < 0.5 for _ in encoded]
    decoded, (out, labels, done) = cpu_feed._batch(rng, encoded, list(range(64)), None)
    assert out.shape == (64, 3, 8, 8) and out.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.tolist() == list(range(64))
    unflipped = resize_batch([ramp] * 64, boxes, 8)
    for i in range(64):
        ref = unflipped[i].flip(-1) if flips[i] else unflipped[i]
        ref = (ref - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
        assert torch.allclose(out[i], ref, atol=1e-5)
    assert any(flips) and not all(flips)


def test_batch_raises_when_the_decoder_gives_none(cpu_feed):
    cpu_feed.decoder.decode = lambda streams, images=None, cuda_stream=0: [None] * len(streams)
    img = torch.zeros(8, 8, 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="could not be decoded"):
        cpu_feed._batch(random.Random(0), [img, img], [0, 1], None)


# ---- the producer thread ------------------------------------------------------------------------------------
def _threaded_feed(batch_fn, encoded_fn, depth=3):
    feed = object.__new__(NvImgFeed)
    feed.ready = queue.Queue(maxsize=depth)
    feed.stopping = threading.Event()
    feed.seed = 0
    feed.device = torch.device("cpu")
    feed._batch = batch_fn
    feed._encoded = encoded_fn
    feed.thread = threading.Thread(target=feed._run, daemon=True)
    feed.thread.start()
    return feed


def _endless(rng):
    while True:
        yield ["x"], [0]


def test_slots_are_reused_ring_wise():
    seen = []

    def batch(rng, encoded, labels, reuse):
        seen.append(reuse)
        return f"decoded{len(seen) - 1}", (torch.zeros(1), torch.zeros(1), None)

    feed = _threaded_feed(batch, _endless, depth=3)
    deadline = time.time() + 10
    while len(seen) < 12 and time.time() < deadline:
        try:
            feed.ready.get(timeout=0.1)
        except queue.Empty:
            pass
    feed.close()
    assert seen[:5] == [None] * 5 and seen[5:10] == [f"decoded{i}" for i in range(5)]


def test_an_error_in_the_thread_reaches_the_consumer_then_next_says_the_thread_ended(monkeypatch):
    def batch(rng, encoded, labels, reuse):
        raise ValueError("boom")

    feed = _threaded_feed(batch, _endless)
    with pytest.raises(ValueError, match="boom"):
        next(feed)
    feed.thread.join(5)
    with pytest.raises(RuntimeError, match="thread ended"):
        next(feed)
    feed.close()


def test_close_returns_while_the_producer_waits_on_a_full_queue():
    feed = _threaded_feed(lambda rng, e, labels, r: (None, (torch.zeros(1), torch.zeros(1), None)), _endless, depth=2)
    deadline = time.time() + 5
    while not feed.ready.full() and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    feed.close()
    assert not feed.thread.is_alive() and time.time() - t0 < 3


def test_close_returns_when_the_producer_is_stuck(monkeypatch):
    """(A defect found in review.) close() looped ``while thread.is_alive()`` with no deadline: a producer stuck in
    ``next()`` of the stream reader (or in a decode that never returns) hung the whole run (close_feed is in
    Bench.row's ``finally``). Now it leaves the thread behind after CLOSE_TIMEOUT_S, with a warning."""
    monkeypatch.setattr(nvimg_feed, "CLOSE_TIMEOUT_S", 1.0)
    release = threading.Event()

    def stuck(rng):
        release.wait()
        yield ["x"], [0]

    feed = _threaded_feed(lambda rng, e, labels, r: (None, (torch.zeros(1), torch.zeros(1), None)), stuck)
    warned = []
    closer = threading.Thread(target=lambda: warned.append(_close_warnings(feed)), daemon=True)
    closer.start()
    closer.join(15)
    returned = not closer.is_alive()
    release.set()
    closer.join(10)
    assert returned, "close() did not return within 15 s (its deadline is 1 s here)"
    assert warned and any("did not stop" in w for w in warned[0])


def _close_warnings(feed) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed.close()
    return [str(w.message) for w in caught]


def test_q0_is_refused():
    """(A defect found in review.) ``q0`` parsed to depth 0, and ``queue.Queue(maxsize=0)`` has no bound: the
    producer would have run ahead without limit, holding a ~150 MB device batch per step until the device ran out
    of memory."""
    with pytest.raises(ValueError):
        nvimg_options("q0")


# ---- how ceiling.py drives it --------------------------------------------------------------------------------
def test_ceiling_helpers_accept_the_feed():
    from bench.ceiling_feeds import close_feed, variant
    from bench.ceiling_record import decoder_choice

    assert variant("nvimg@hw0.5+stream") == ("nvimg", {"hw": 0.5, "stream": True})
    calls = []

    class Feed:
        def close(self):
            calls.append(1)

    f = Feed()
    assert decoder_choice(f) == {}
    close_feed(f, f)
    assert calls == [1]


# ---- nvImageCodec itself, where its wheel imports (no GPU needed for these) ---------------------------------
def _jpeg(w, h, orientation=None):
    from PIL import Image

    im = Image.new("RGB", (w, h), (200, 10, 10))
    b = io.BytesIO()
    if orientation:
        exif = im.getexif()
        exif[0x0112] = orientation
        im.save(b, "JPEG", exif=exif)
    else:
        im.save(b, "JPEG")
    return b.getvalue()


def test_codestream_takes_a_read_only_view_into_a_mapping_and_keeps_it_alive(tmp_path):
    nv = pytest.importorskip("nvidia.nvimgcodec")
    import mmap

    import numpy as np

    path = tmp_path / "x.jpg"
    path.write_bytes(_jpeg(40, 20))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(memoryview(m), dtype=np.uint8)
    assert not arr.flags.writeable
    cs = nv.CodeStream(arr)
    del arr
    assert (cs.height, cs.width) == (20, 40)
    with pytest.raises(BufferError):
        m.close()  # the CodeStream still holds the view
    del cs


def test_boxes_come_from_the_decoded_size(cpu_feed):
    """(A defect found in review.) The boxes came from the stored size (``CodeStream.height/width``) while ``decode``
    applies EXIF orientation: a rotated JPEG decodes W x H and its box lay partly outside. Now a decoder that hands
    back each image transposed still gets every box inside what it decoded."""
    stored = torch.full((20, 40, 3), 100, dtype=torch.uint8)
    cpu_feed.decoder.decode = lambda streams, images=None, cuda_stream=0: [
        _FakeImage(cs.data.transpose(0, 1).contiguous()) for cs in streams]
    seen = []
    real = nvimg_feed.random_crop

    def spy(rng, height, width):
        box = real(rng, height, width)
        seen.append((height, width, box))
        return box

    import unittest.mock

    with unittest.mock.patch.object(nvimg_feed, "random_crop", spy):
        _, (out, _, _) = cpu_feed._batch(random.Random(0), [stored] * 16, list(range(16)), None)
    assert {(h, w) for h, w, _ in seen} == {(40, 20)}
    assert all(y0 + h <= 40 and x0 + w <= 20 for _, _, (y0, x0, h, w) in seen)
    ref = (100 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    assert torch.allclose(out, ref.expand_as(out[0]).expand_as(out), atol=1e-3)  # no padding read anywhere


def test_the_decoder_takes_preallocation_hints_or_is_made_without_them():
    """The hardware decoder is asked to preallocate (else nvJPEG grows its buffers with ``cudaFree``, which waits for
    the whole device); an nvImageCodec that refuses the options still gives a decoder, with a warning."""
    import warnings

    made = []

    class Nv:
        class Decoder:
            def __init__(self, device_id, backends, options=""):
                if options:
                    made.append(options)
                    raise RuntimeError("unknown option")
                made.append("plain")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nvimg_feed.make_decoder(Nv, 0, [], 256)
    assert "preallocate_batch_size=256" in made[0] and made[1] == "plain"
    assert any("preallocation hints" in str(w.message) for w in caught)


def test_the_fallback_crop_keeps_the_image_or_clamps_its_aspect():
    """After ten draws that do not fit, torchvision's rule: the whole image when its aspect is inside 3/4-4/3, else
    the centre clamped to that range (a random stream whose draws never fit stands in)."""

    class Never(random.Random):
        def uniform(self, a, b):
            return b if a > 0 else a  # the whole area at aspect 3/4: fits none of these three images

    assert random_crop(Never(0), 375, 500) == (0, 0, 375, 500)
    assert random_crop(Never(0), 100, 400) == (0, 133, 100, 133)
    assert random_crop(Never(0), 400, 100) == (133, 0, 133, 100)


@pytest.mark.gpu
def test_on_a_gpu_both_backends_decode_like_pil_and_the_feed_makes_normalised_batches(tmp_path):
    """Both nvImageCodec backends decode a synthetic JPEG within a few levels of PIL (colour order and values), and
    the feed, plain and reading the shards, makes batches of ImageLoader's format (bench/decoder_bound.py --nvimg
    times it)."""
    import numpy as np
    from PIL import Image

    from bench.images import ensure_dataset

    nv = pytest.importorskip("nvidia.nvimgcodec")
    urls, _ = ensure_dataset(str(tmp_path / "images"), 600, workers=2, per_shard=256)
    jpeg = read_samples(urls[:1])[0][0]
    ref = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float32)
    for kind in ("HW_GPU_ONLY", "GPU_ONLY"):
        image = nv.Decoder(backends=[nv.Backend(getattr(nv.BackendKind, kind))]).decode([nv.CodeStream(jpeg)])[0]
        got = torch.from_dlpack(image).cpu().numpy().astype(np.float32)
        assert got.shape == ref.shape and np.abs(got - ref).mean() < 3, kind
    for spec in ("", "stream"):
        feed = NvImgFeed(urls, batch_size=64, image_size=224, device=torch.device("cuda"), opts=nvimg_options(spec))
        try:
            x, y = next(feed)
            x, y = next(feed)
        finally:
            feed.close()
        assert x.shape == (64, 3, 224, 224) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert abs(x.mean().item()) < 2 and 0.2 < x.std().item() < 3  # normalised
