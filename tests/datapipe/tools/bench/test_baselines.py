"""datapipe.tools.bench.baselines: the baselines every benchmark compares against."""
import importlib.util
import itertools

import pytest
import torch

from datapipe.tools.bench import baselines

HAVE_DALI = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from datapipe.tools.synthetic import make_image_dataset

    d = tmp_path_factory.mktemp("img")
    make_image_dataset(str(d), num_images=20, num_classes=5, shard_max_count=10, size=(40, 30), progress=False)
    return str(d)


def _urls(d):
    from datapipe import expand_urls

    return expand_urls(d + "/shard-{000000..000001}.tar")


def test_transforms_give_normalised_chw(image_dir):
    from PIL import Image

    img = Image.new("RGB", (40, 30), (124, 116, 104))  # ~ the ImageNet mean: normalises to ~0
    for t in (baselines.PilEval(16), baselines.PilTrain(16), baselines.PilTrain(16, torchvision=False)):
        x = t(img)
        assert x.shape == (3, 16, 16) and x.dtype == torch.float32
        assert x.abs().max() < 0.05
    with pytest.raises(ValueError, match="size"):
        baselines.PilEval(0)


def test_image_bytes_names_the_sample_without_image():
    assert baselines.image_bytes({"__key__": "a", "png": b"x", "cls": b"1"}) == b"x"
    with pytest.raises(KeyError, match="'k7'"):
        baselines.image_bytes({"__key__": "k7", "cls": b"1"})


@pytest.mark.parametrize("make", [baselines.torch_loader, baselines.webdataset_loader])
@pytest.mark.parametrize("train", [True, False])
def test_cpu_loaders_read_every_image_once(image_dir, make, train):
    loader = make(_urls(image_dir), batch_size=4, image_size=8, train=train, workers=0)
    batches = list(loader)
    n = sum(len(y) for _, y in batches)
    assert n == 20  # 20 images, batch 4: no partial batch to drop
    x, y = batches[0]
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.float32
    assert torch.as_tensor(y).dtype == torch.int64


def test_eval_order_is_shard_order(image_dir):
    a = [int(v) for _, y in baselines.torch_loader(_urls(image_dir), batch_size=5, train=False) for v in y]
    b = [int(v) for _, y in baselines.webdataset_loader(_urls(image_dir), batch_size=5, train=False) for v in y]
    assert a == b and len(a) == 20


@pytest.mark.skipif(not HAVE_DALI, reason="DALI not installed")
@pytest.mark.parametrize("train", [True, False])
def test_dali_baseline_on_cpu(image_dir, train):
    dali = baselines.DaliBaseline(_urls(image_dir), batch_size=5, image_size=8, train=train, device="cpu", threads=1)
    got = list(itertools.islice(iter(dali), 5))  # one epoch and one batch more: it runs on
    for x, y in got:
        assert x.shape == (5, 3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    if not train:  # eval: shard order, the same labels as the torch baseline
        ref = [int(v) for _, y in baselines.torch_loader(_urls(image_dir), batch_size=5, train=False) for v in y]
        assert [int(v) for _, y in got[:4] for v in y] == ref


def test_dali_baseline_refuses_bad_arguments(image_dir):
    pytest.importorskip("nvidia.dali")
    with pytest.raises(ValueError, match="local"):
        baselines.DaliBaseline(["http://127.0.0.1:9/a.tar"], batch_size=2)
    with pytest.raises(ValueError, match="device"):
        baselines.DaliBaseline(_urls(image_dir), batch_size=2, device="tpu")


class Epochs:
    def __init__(self, sizes):
        self.sizes, self.epochs = sizes, []

    def set_epoch(self, e):
        self.epochs.append(e)

    def __iter__(self):
        return iter(range(self.sizes[len(self.epochs) - 1]))


def test_endless_runs_epochs_and_refuses_an_empty_one():
    src = Epochs([2, 3, 0])
    gen = baselines.endless(src)
    assert [next(gen) for _ in range(5)] == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="no batches"):
        next(gen)
    assert src.epochs == [0, 1, 2]


def test_endless_close_shuts_the_epoch_down():
    closed = []

    def epoch():
        try:
            yield from range(10)
        finally:
            closed.append(True)

    class Src:
        def __iter__(self):
            return epoch()

    gen = baselines.endless(Src())
    next(gen)
    gen.close()
    assert closed == [True]


def test_replay_repeats_the_same_batch():
    batch = torch.ones(2)
    got = list(itertools.islice(baselines.replay(batch), 3))
    assert all(b is batch for b in got)
