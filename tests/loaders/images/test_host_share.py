import glob
import os

import numpy as np
import pytest
import torch

from loaders.images import host_share
from loaders.images.host_share import HostShare

S = 32


def test_fixed_share_marks_the_first_k_images_of_every_batch():
    share = HostShare(8, 0.5)
    marks = [bool(p) for p in share.predicates()]
    assert marks == [True] * 4 + [False] * 4
    assert [bool(p) for p in share.predicates_for(3)] == [True] * 3  # a short last batch: all it has
    assert HostShare(8, 0).predicates_for(8) == [False] * 8
    assert all(p.shape == () and p.dtype == np.bool_ for p in share.predicates())


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", None])
def test_share_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="cpu_share"):
        HostShare(8, bad)


def test_auto_moves_towards_the_busy_target_and_stays_in_bounds():
    share = HostShare(256, "auto")
    assert 0 < share.k <= share.limit == int(host_share.MAX_SHARE * 256)
    start = share.k
    share.decide(busy=0.1, waited=0.0)  # idle CPU threads: more images to the CPU, at most doubling
    assert start < share.k <= 2 * start
    for _ in range(20):
        share.decide(busy=0.05, waited=0.0)
    assert share.k == share.limit  # never past the cap
    share.decide(busy=1.0, waited=0.0)  # saturated: fewer
    assert share.k < share.limit
    # proportional: with busy = k * c, the fixed point is where busy == TARGET_BUSY
    per_image = 0.004
    for _ in range(30):
        share.decide(busy=share.k * per_image, waited=0.0)
    assert abs(share.k * per_image - host_share.TARGET_BUSY) < 0.05


def test_auto_backs_off_when_the_consumer_waits_on_a_busy_cpu_and_probes_from_zero():
    share = HostShare(256, "auto")
    k = share.k
    share.decide(busy=0.9, waited=0.1)
    assert share.k == int(k * 0.7)
    share.k = 40
    share.decide(busy=0.1, waited=0.1)  # waits while the CPU idles: not the CPU half's fault, no back-off
    assert share.k > 40
    share.k = 0
    share.decide(busy=0.0, waited=0.0)
    assert share.k == share.limit // 8
    assert len(share.history) == 3


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread CPU times come from /proc (Linux)")
def test_dali_pool_threads_are_found_and_their_cpu_time_counted(tmp_path):
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def, types

    before = host_share.dali_pool_threads()

    @pipeline_def(batch_size=16, num_threads=3, device_id=None)
    def busy():
        return fn.random.uniform(range=[0, 1], shape=[200_000], dtype=types.FLOAT)

    pipe = busy()
    pipe.build()
    threads = host_share.dali_pool_threads() - before
    assert len(threads) == 3
    t0 = host_share.threads_cpu_seconds(threads)
    for _ in range(20):
        pipe.run()
    assert host_share.threads_cpu_seconds(threads) > t0
    del pipe


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from tools.synthetic import make_image_dataset

    out = tmp_path_factory.mktemp("images")
    info = make_image_dataset(str(out), num_images=24, num_classes=10, seed=3, shard_max_count=12,
                              size=(80, 60), progress=False)
    return info["shards"]


def _run(paths, share):
    from loaders.images.dali_pipeline import build_image_pipeline

    reader = dict(paths=paths, ext=["jpg", "cls"], random_shuffle=False)
    pipe = build_image_pipeline(batch_size=8, image_size=S, train=False, device="cpu", device_id=None, reader=reader,
                                pad_labels=True, host_share=share, num_threads=2)
    pipe.build()
    images, labels = [], []
    for _ in range(3):
        x, y = pipe.run()
        images.append(np.stack([np.array(t) for t in x]))
        labels.append(np.array(y.as_tensor()))
    return np.concatenate(images), np.concatenate(labels)


def test_split_batches_merge_back_in_order(shards):
    """Both halves of a split batch (on a CPU pipeline both decode on the CPU) come back where they were."""
    pytest.importorskip("nvidia.dali")
    paths = sorted(shards)
    plain_x, plain_y = _run(paths, None)
    for share in (0.25, 0.5, 1.0):
        x, y = _run(paths, HostShare(8, share))
        assert np.array_equal(y, plain_y)
        assert np.array_equal(x, plain_x)


def test_split_stream_source_handles_a_short_last_batch(shards):
    """The stream reader's external source: one predicate per image actually fed."""
    pytest.importorskip("nvidia.dali")
    from loaders.images.dali_pipeline import build_image_pipeline

    jpegs = [np.fromfile(p, dtype=np.uint8) for p in sorted(glob.glob(os.path.join(_unpacked(shards), "*.jpg")))]
    feeds = iter([jpegs[:8], jpegs[8:11]])
    pipe = build_image_pipeline(batch_size=8, image_size=S, train=False, device="cpu", device_id=None,
                                source=lambda: next(feeds), host_share=HostShare(8, 0.5), num_threads=2)
    pipe.build()
    (full,), (short,) = pipe.run(), pipe.run()
    assert len(full) == 8 and len(short) == 3


def _unpacked(shards) -> str:
    import tarfile

    out = os.path.join(os.path.dirname(shards[0]), "unpacked")
    if not os.path.isdir(out):
        with tarfile.open(shards[0]) as tar:
            tar.extractall(out, filter="data")
    return out


def test_image_loader_splits_only_where_there_is_a_gpu_half(shards):
    pytest.importorskip("nvidia.dali")
    from loaders.images.loader import ImageLoader

    cpu = ImageLoader(shards, batch_size=8, image_size=S, device="cpu", train=False, cpu_share=0.5)
    assert cpu.cpu_share == 0.0 and cpu.host_share is None  # all on the CPU already: nothing to split
    with pytest.raises(ValueError, match="cpu_share"):
        ImageLoader(shards, batch_size=8, device="cpu", cpu_share=2)


@pytest.mark.gpu
def test_gpu_split_agrees_with_unsplit_and_auto_reports_its_share(shards):
    from loaders.images.loader import ImageLoader

    def collect(loader):
        xs, ys = zip(*[(x.cpu(), y.cpu()) for x, y in loader])
        return torch.cat(xs), torch.cat(ys)

    args = dict(batch_size=8, image_size=S, device="cuda", train=False)
    gpu_x, gpu_y = collect(ImageLoader(shards, cpu_share=0.0, **args))
    half = ImageLoader(shards, cpu_share=0.5, **args)
    x, y = collect(half)
    assert half.host_share is not None and half.stats()["cpu_share"] == 0.5
    assert y.tolist() == gpu_y.tolist()
    assert (x - gpu_x).abs().mean() < 0.05  # libjpeg-turbo vs nvJPEG: IDCT and chroma upsampling differ slightly
    auto = ImageLoader(shards, **{**args, "train": True})
    for _ in range(2):
        collect(auto)
    assert 0.0 <= auto.stats().get("cpu_share", 0.0) <= host_share.MAX_SHARE
