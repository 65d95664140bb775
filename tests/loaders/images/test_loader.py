import io
import logging
import os

import numpy as np
import pytest
import torch
import webdataset
from PIL import Image

pytest.importorskip("nvidia.dali")

from dataclasses import fields  # noqa: E402

from datapipe.errors import DataError  # noqa: E402
from datapipe.stream import ShardStream  # noqa: E402
from datapipe.tools.synthetic import iter_image_samples, make_image_dataset  # noqa: E402
from loaders.images.loader import IMAGENET_MEAN, IMAGENET_STD, ImageLoader  # noqa: E402
from loaders.images.options import AugmentOptions, DecodeOptions, ReadOptions  # noqa: E402

S = 32  # output size: small keeps the CPU pipeline fast
N = 40


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("images")
    info = make_image_dataset(str(out), num_images=N, num_classes=10, seed=5, shard_max_count=12,
                              size=(96, 72), progress=False)
    return info["shards"]


STREAM = ("shuffle", "seed", "shuffle_buffer", "rank", "world_size", "on_error")


def loader(urls, **kwargs):
    """An ImageLoader from flat keyword arguments: the stream's settings build its ShardStream (as the
    loader's defaults would: shuffle with train, a 2000-sample buffer), the rest go to their option group."""
    args = dict(batch_size=8, image_size=S, device="cpu", train=False)
    kwargs.setdefault("num_threads", 2)
    stream = {k: kwargs.pop(k) for k in STREAM if k in kwargs}
    groups = {}
    for name, cls in (("decode", DecodeOptions), ("augment", AugmentOptions), ("read", ReadOptions)):
        given = {f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs}
        groups[name] = cls(**given)
    args.update(kwargs)
    source = urls
    if stream:
        shuffle = stream.pop("shuffle", args["train"])
        buffer = stream.pop("shuffle_buffer", 2000)
        source = ShardStream(urls, shuffle=shuffle, shuffle_buffer=buffer if shuffle else 0, **stream)
    return ImageLoader(source, **groups, **args)


def by_key(**kwargs):
    """Labels are the sample keys: every sample identifiable."""
    return dict(label_key="__key__", label_decoder=int, **kwargs)


def collect(it):
    xs, ys = [], []
    for x, y in it:
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def reference_eval(jpg: bytes, size: int) -> np.ndarray:
    """torchvision-style eval transform in PIL: resize shorter side (bilinear, antialiased), center crop, normalise."""
    im = Image.open(io.BytesIO(jpg)).convert("RGB")
    w, h = im.size
    scale = size / min(w, h)
    im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BILINEAR)
    w, h = im.size
    left, top = (w - size) // 2, (h - size) // 2
    a = np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.float32) / 255
    return ((a - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)).transpose(2, 0, 1)


def test_eval_shapes_labels_and_order(shards):
    dl = loader(shards)
    batches = list(dl)
    assert len(batches) == len(dl) == 5
    x, y = collect(batches)
    assert x.shape == (N, 3, S, S) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    expected = [int(s["cls"]) for s in webdataset.WebDataset(shards, shardshuffle=False)]
    assert y.tolist() == expected  # eval: shard order
    assert dl.stats()["samples"] == N and dl.stats()["skipped"] == 0
    seconds = dl.stats()["seconds"]  # where next() spent its time
    assert set(seconds) == {"wait", "read", "dali", "copy"} and min(seconds.values()) >= 0 and seconds["dali"] > 0
    producer = dl.stats()["producer"]  # the producer thread's CPU time (bounds its share of the GIL)
    assert producer["batches"] == 5 and producer["cpu_s"] > 0


def test_eval_matches_a_pil_reference(shards):
    x, _ = collect(loader(shards, batch_size=16))
    samples = list(webdataset.WebDataset(shards, shardshuffle=False))
    ref = np.stack([reference_eval(s["jpg"], S) for s in samples])
    diff = np.abs(x.numpy() - ref)
    assert diff.mean() < 0.03, diff.mean()  # normalised units: 1/255 is ~0.017 (resize rounding differs)
    assert np.median(diff) < 0.02
    # a wrong mean/std or a channel swap is far outside this tolerance
    assert np.abs(x.numpy()[:, ::-1] - ref).mean() > 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8])
def test_dtypes_and_layout(shards, dtype):
    ref, _ = collect(loader(shards[:1]))
    x, _ = collect(loader(shards[:1], dtype=dtype, layout="NHWC"))
    assert x.dtype == dtype and x.shape == (12, S, S, 3)
    got = x.permute(0, 3, 1, 2).float()
    if dtype == torch.uint8:  # raw pixels
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
        got = (got - mean) / std
        assert (got - ref).abs().max() < 0.05
    else:
        assert (got - ref).abs().max() < 0.05


def test_train_is_deterministic_for_a_seed_and_augments(shards):
    a = collect(loader(shards, train=True, seed=1))
    b = collect(loader(shards, train=True, seed=1))
    c = collect(loader(shards, train=True, seed=2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])  # another shuffle
    assert a[0].shape == (N // 8 * 8, 3, S, S)  # drop_last defaults to train
    assert len(loader(shards, train=True)) == N // 8
    eval_x, _ = collect(loader(shards))
    assert not torch.allclose(torch.sort(a[0].flatten())[0], torch.sort(eval_x.flatten())[0])


def test_train_epochs_cover_every_sample_and_differ(shards):
    dl = loader(shards, train=True, drop_last=False, **by_key())
    _, e0 = collect(dl)
    dl.set_epoch(1)
    _, e1 = collect(dl)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(N))
    assert e0.tolist() != e1.tolist()


def test_resume_yields_exactly_the_rest(shards):
    full = loader(shards, shuffle=True, **by_key())
    full.set_epoch(3)
    xs, ys = collect(full)
    first = loader(shards, shuffle=True, **by_key())
    first.set_epoch(3)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    state = first.state_dict()
    it.close()
    rest = loader(shards, shuffle=True, **by_key())
    rest.load_state_dict(state)
    tail = list(rest)
    rx, ry = collect(head + tail)
    assert ry.tolist() == ys.tolist()
    assert torch.equal(rx, xs)
    assert rest.epoch == 4  # the rest of epoch 3 ran to its end: the next pass is epoch 4


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_are_disjoint_and_complete(shards, world):
    seen = []
    for rank in range(world):
        dl = loader(shards, train=True, drop_last=False, rank=rank, world_size=world, **by_key())
        _, y = collect(dl)
        assert len(y) == -(-N // world)  # every rank the same number of samples
        seen.append(set(y.tolist()))
    assert set().union(*seen) == set(range(N))
    if N % world == 0:
        assert sum(len(s) for s in seen) == N


def _broken_frame(jpg: bytes) -> bytes:
    """A JPEG whose frame header names an undefined quantisation table: its header walks fine (the check before
    DALI passes it), DALI's decoder fails on it (a decode error, not a crash)."""
    i = jpg.find(b"\xff\xc0")
    return jpg[:i + 12] + b"\x07" + jpg[i + 13:]


def _corrupt_shards(tmp_path):
    """12 good samples, a garbage image, a truncated JPEG, a JPEG DALI cannot decode, a sample without image,
    a bad label."""
    good = list(iter_image_samples(12, seed=9, num_classes=10, size=(96, 72)))
    bad = [
        {"__key__": "bad-garbage", "jpg": b"not an image at all, just text" * 5, "cls": b"1"},
        {"__key__": "bad-truncated", "jpg": good[0]["jpg"][: len(good[0]["jpg"]) // 2], "cls": b"2"},
        {"__key__": "bad-frame", "jpg": _broken_frame(good[2]["jpg"]), "cls": b"4"},
        {"__key__": "bad-noimage", "txt": b"hello", "cls": b"3"},
        {"__key__": "bad-label", "jpg": good[1]["jpg"], "cls": b"three"},
    ]
    samples = good[:3] + bad[:3] + good[3:9] + bad[3:] + good[9:]
    path = str(tmp_path / "shard-000000.tar")
    with webdataset.TarWriter(path) as w:
        for s in samples:
            w.write(s)
    return [path], [int(s["cls"]) for s in good]


def test_corrupt_images_raise(tmp_path):
    urls, _ = _corrupt_shards(tmp_path)
    with pytest.raises(DataError) as e:  # the stream reader checks signatures before DALI sees them
        list(loader(urls, batch_size=4, reader="stream"))
    assert e.value.key == "bad-garbage" and "shard-000000.tar" in str(e.value)


def test_dali_reader_turns_a_decode_failure_into_a_data_error(tmp_path):
    urls, _ = _corrupt_shards(tmp_path)
    with pytest.raises(DataError, match="lacks an image") as e:  # the first failure: a sample without an image
        list(loader(urls, batch_size=4, reader="dali", index_dir=str(tmp_path / "ix")))
    assert "shard-000000.tar" in str(e.value) and e.value.key == "bad-noimage"


def test_truncated_jpeg_raises_with_its_key(tmp_path):
    """A JPEG with a valid header but cut short passes the signature check and fails in DALI."""
    good = list(iter_image_samples(6, seed=9, num_classes=10, size=(96, 72)))
    good[3] = {**good[3], "__key__": "bad-truncated", "jpg": good[3]["jpg"][: len(good[3]["jpg"]) // 2]}
    tar = str(tmp_path / "truncated.tar")
    with webdataset.TarWriter(tar) as w:
        for s in good:
            w.write(s)
    with pytest.raises(DataError) as e:  # the stream reader finds the missing end marker before DALI sees it
        list(loader([tar], batch_size=4, reader="stream"))
    assert e.value.key == "bad-truncated" and "truncated JPEG" in str(e.value) and "truncated.tar" in str(e.value)
    with pytest.raises(DataError, match="DALI's reader, batch 0") as e:  # DALI names the sample
        list(loader([tar], batch_size=4, reader="dali", index_dir=str(tmp_path / "ix")))
    assert e.value.key == "bad-truncated" and "truncated.tar" in str(e.value)


def _truncated_in_a_folder(tmp_path):
    """A shard whose keys have folders (as `datapipe shard` of an image folder writes them), one JPEG cut short."""
    samples = list(iter_image_samples(6, seed=9, num_classes=10, size=(96, 72)))
    for i, s in enumerate(samples):
        s["__key__"] = f"astronaut/img{i}"
    samples[3] = {**samples[3], "__key__": "astronaut/broken_truncated", "jpg": samples[3]["jpg"][:2000]}
    tar = str(tmp_path / "shard-000000.tar")
    with webdataset.TarWriter(tar) as w:
        for s in samples:
            w.write(s)
    return tar


def test_dali_reader_decode_failure_names_shard_and_key_from_dalis_text(tmp_path):
    """DALI says 'Failed to decode sample #3 : <tar>:<offset>:astronaut/broken_truncated.jpg': the DataError
    carries that key (webdataset's: the member name up to its first dot) and the shard's URL as given."""
    url = "file://" + _truncated_in_a_folder(tmp_path)
    with pytest.raises(DataError) as e:
        list(loader([url], batch_size=4, reader="dali", index_dir=str(tmp_path / "ix")))
    assert e.value.key == "astronaut/broken_truncated" and e.value.url == url
    assert "astronaut/broken_truncated.jpg" in str(e.value) and "batch 0" in str(e.value)


def test_a_truncated_jpeg_is_skipped_before_dali_prints_anything(tmp_path, capfd):
    dl = loader([_truncated_in_a_folder(tmp_path)], batch_size=4, on_error="skip", reader="stream")
    _, y = collect(dl)
    assert len(y) == 5 and dl.stats()["skipped"] == 1 and dl.stats()["decode_errors"] == 0
    assert "astronaut/broken_truncated" in dl.stats()["last_errors"][0]
    assert "libjpeg" not in capfd.readouterr().err  # DALI's decoder never saw it: no raw [ERROR] lines


@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_corrupt_images_skip_and_warn(tmp_path, caplog, mode):
    urls, labels = _corrupt_shards(tmp_path)
    dl = loader(urls, batch_size=4, on_error=mode)
    with caplog.at_level(logging.WARNING):
        x, y = collect(dl)
    assert y.tolist() == labels  # every good sample, in order, none of the bad ones
    assert x.shape == (12, 3, S, S) and torch.isfinite(x).all()
    stats = dl.stats()
    assert stats["skipped"] == 5 and stats["decode_errors"] == 1 and stats["samples"] == 12
    assert any("bad-truncated" in m and "truncated JPEG" in m for m in stats["last_errors"])  # found before DALI
    assert any("bad-frame" in m for m in stats["last_errors"])  # found by DALI
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    assert (len(warned) >= 5) == (mode == "warn")


def test_dali_reader_gives_the_same_batches(shards):
    stream_x, stream_y = collect(loader(shards, reader="stream"))
    dl = loader(shards, reader="dali", index_dir=os.path.join(os.path.dirname(shards[0]), "ix"))
    x, y = collect(dl)
    assert y.tolist() == stream_y.tolist()
    assert torch.equal(x, stream_x)
    assert len(os.listdir(os.path.join(os.path.dirname(shards[0]), "ix"))) == len(shards)


def test_stats_stream_holds_the_streams_counts_or_none_when_dali_reads(shards):
    dl = loader(shards, reader="stream")
    collect(dl)
    st = dl.stats()
    assert st["reader"] == "stream" and st["stream"]["samples"] == N and st["stream"]["shards_opened"] == len(shards)
    dl = loader(shards, reader="dali", index_dir=os.path.join(os.path.dirname(shards[0]), "ix-stats"))
    collect(dl)
    st = dl.stats()
    assert st["reader"] == "dali" and st["samples"] == N
    assert st["stream"] is None  # DALI's reader read the shards: no stream counters that read 0


def test_bad_arguments(shards):
    with pytest.raises(ValueError):
        loader(shards, layout="CHW")
    with pytest.raises(ValueError):
        loader(shards, dtype=torch.int32)
    with pytest.raises(ValueError):
        loader(shards, on_error="ignore")
    with pytest.raises(ValueError):
        loader(["s3://bucket/shard-000000.tar"], reader="dali")


def test_urls_and_a_stream_compose_the_same_loader(shards):
    """URLs: the loader builds the stream (train: shuffled, seed 0); a ShardStream is used as it is."""
    from_urls = ImageLoader(shards, batch_size=8, image_size=S, device="cpu", train=True,
                            decode=DecodeOptions(num_threads=2),
                            read=ReadOptions(label_key="__key__", label_decoder=int))
    assert (from_urls.stream.shuffle, from_urls.stream.shuffle_buffer, from_urls.stream.seed) == (True, 2000, 0)
    assert from_urls.stream.storage.zero_copy and from_urls.drop_last
    own = ShardStream(shards, shuffle=True, shuffle_buffer=2000, seed=0)
    from_stream = ImageLoader(own, batch_size=8, image_size=S, device="cpu", train=True,
                              decode=DecodeOptions(num_threads=2), read=ReadOptions(label_key="__key__",
                                                                                     label_decoder=int))
    assert not own.storage.zero_copy and from_stream.stream.storage.zero_copy  # the caller's stream is not changed
    a, b = collect(from_urls), collect(from_stream)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    folder = ImageLoader(os.path.dirname(shards[0]), batch_size=8, image_size=S, device="cpu", train=False,
                         decode=DecodeOptions(num_threads=2))
    assert len(folder.stream.urls) == len(shards) and sum(len(y) for _, y in folder) == N  # a folder: its shards
    evaluation = ImageLoader(shards, batch_size=8, image_size=S, device="cpu", train=False)
    assert (evaluation.stream.shuffle, evaluation.stream.shuffle_buffer) == (False, 0) and not evaluation.drop_last
    seeded = ImageLoader(ShardStream(shards, shuffle=True, seed=4, on_error="skip"), batch_size=8, image_size=S,
                         device="cpu")
    assert seeded.stream.seed == 4 and seeded.reader == "stream"  # skip: only the stream reader honours it


def test_options_are_groups_checked_where_they_are_made(shards):
    import inspect

    assert len(inspect.signature(ImageLoader).parameters) <= 12
    for make in (lambda: DecodeOptions(layout="CHW"), lambda: DecodeOptions(hw_decoder_load=2),
                 lambda: DecodeOptions(num_threads=0), lambda: AugmentOptions(random_area=(0.5, 0.1)),
                 lambda: ReadOptions(reader="fast"), lambda: ReadOptions(prefetch_queue_depth=0)):
        with pytest.raises(ValueError):
            make()
    with pytest.raises(TypeError, match="decode="):
        ImageLoader(shards, batch_size=8, device="cpu", decode={"layout": "NHWC"})
    with pytest.raises(TypeError):  # the stream's settings are the stream's
        ImageLoader(shards, batch_size=8, device="cpu", shuffle=True)
    with pytest.raises(ValueError, match="resize_size"):
        ImageLoader(shards, batch_size=8, image_size=64, device="cpu", decode=DecodeOptions(resize_size=32))


def test_a_stream_with_decode_steps_is_refused(shards):
    with pytest.raises(ValueError, match="decodes the images itself"):
        ImageLoader(ShardStream(shards).decode("pil"), batch_size=8, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(shards):
    with pytest.raises(ValueError, match=r"CUDA is not available here; use device='cpu'"):
        ImageLoader(shards, batch_size=8)


@pytest.mark.gpu
def test_gpu_pipeline_agrees_with_cpu(shards):
    cpu_x, cpu_y = collect(loader(shards))
    gpu = loader(shards, device="cuda")
    gpu_x, gpu_y = collect(gpu)
    assert gpu_x.is_cuda and gpu_y.is_cuda
    assert gpu_y.cpu().tolist() == cpu_y.tolist()
    diff = (gpu_x.cpu() - cpu_x).abs()
    assert diff.mean() < 0.05, diff.mean()  # GPU JPEG decoding differs slightly (IDCT, chroma upsampling)
    tx, ty = collect(loader(shards, device="cuda", train=True, dtype=torch.bfloat16))
    assert tx.dtype == torch.bfloat16 and tx.shape == (N // 8 * 8, 3, S, S) and tx.is_cuda


def test_reader_workers_cover_every_sample_once_per_epoch(shards):
    dl = loader(shards, train=True, read_workers=2, drop_last=False, **by_key())
    _, e0 = collect(dl)
    dl.set_epoch(1)
    _, e1 = collect(dl)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(N))
    assert e0.tolist() != e1.tolist()


def test_reader_workers_resume_exactly(shards):
    full = loader(shards, shuffle=True, read_workers=2, **by_key())
    full.set_epoch(2)
    xs, ys = collect(full)
    first = loader(shards, shuffle=True, read_workers=2, **by_key())
    first.set_epoch(2)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    it.close()
    rest = loader(shards, shuffle=True, read_workers=2, **by_key())
    rest.load_state_dict(state)
    rx, ry = collect(head + list(rest))
    assert ry.tolist() == ys.tolist() and torch.equal(rx, xs)
    with pytest.raises(ValueError, match="read_workers"):
        loader(shards, shuffle=True, **by_key()).load_state_dict(state)


def test_reader_workers_skip_and_count_corrupt_images(tmp_path):
    urls, labels = _corrupt_shards(tmp_path)
    dl = loader(urls, batch_size=4, on_error="skip", read_workers=2)
    _, y = collect(dl)
    assert sorted(y.tolist()) == sorted(labels)
    assert dl.stats()["skipped"] == 5


@pytest.mark.parametrize("drop_last", [False, True])
def test_dali_reader_epochs_stay_aligned_with_one_pipeline(shards, drop_last):
    """One DALI pipeline serves every epoch, and each epoch is the whole shard set once."""
    _, reference = collect(loader(shards, reader="stream"))
    ix = os.path.join(os.path.dirname(shards[0]), "ix2")
    dl = loader(shards, reader="dali", index_dir=ix, train=True, batch_size=7, drop_last=drop_last)
    pipes = set()
    for epoch in range(3):
        dl.set_epoch(epoch)
        _, y = collect(dl)
        pipes.add(id(dl._source._pipe))
        if drop_last:
            assert len(y) == N // 7 * 7
        else:  # the same labels as the dataset, each sample once (epochs never spill into each other)
            assert sorted(y.tolist()) == sorted(reference.tolist())
    assert len(pipes) == 1  # reused, not rebuilt per epoch


def test_dali_reader_resumes_exactly_mid_epoch_and_across_epochs(shards):
    """A DALI pipeline checkpoint in state_dict: resume at any batch gives the uninterrupted run."""
    from tests.resume import assert_resumes_identically

    ix = os.path.join(os.path.dirname(shards[0]), "ix3")

    def make():
        return loader(shards, reader="dali", index_dir=ix, train=True, batch_size=6)

    def two_epochs(dl):
        while dl.epoch < 2:  # each pass that runs to its end moves the epoch on
            yield from dl

    full = assert_resumes_identically(
        make, steps=[0, 1, 3, 6, 7, 9], iterate=two_epochs,
        same=lambda a, b: torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    assert len(full) == 2 * (N // 6)
    first, second = torch.cat([y for _, y in full[:N // 6]]), torch.cat([y for _, y in full[N // 6:]])
    assert first.tolist() != second.tolist()  # reshuffled per epoch, augmentations too
    with pytest.raises(ValueError, match="reader"):
        loader(shards, reader="stream").load_state_dict(make().state_dict())


def test_dali_reader_labels_with_newlines_take_the_slow_path(tmp_path):
    samples = [{**s, "cls": s["cls"] + b"\n"} for s in iter_image_samples(6, seed=3, num_classes=10, size=(64, 48))]
    tar = str(tmp_path / "nl.tar")
    with webdataset.TarWriter(tar) as w:
        for s in samples:
            w.write(s)
    _, y = collect(loader([tar], batch_size=4, reader="dali", index_dir=str(tmp_path / "ix")))
    assert y.tolist() == [int(s["cls"]) for s in samples]


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_many_epochs_hold_no_growing_set_of_objects(shards, reader):
    """Epoch after epoch (a partial last batch each) the loader keeps no more threads, objects or RSS."""
    import gc
    import resource
    import threading

    it_loader = loader(shards, batch_size=7, train=True, drop_last=False, reader=reader)

    def epochs(n, start):
        for e in range(start, start + n):
            it_loader.set_epoch(e)
            for _ in it_loader:
                pass
        gc.collect()
        return len(gc.get_objects()), threading.active_count(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    objects0, threads0, _ = epochs(3, 0)
    _, _, rss0 = epochs(3, 3)
    objects1, threads1, rss1 = epochs(12, 6)
    assert threads1 <= threads0  # fewer: a thread of an earlier test's dropped loader finished meanwhile
    assert objects1 - objects0 < 2000  # a per-epoch leak of the pipeline, streams or batches would be 10k+
    assert rss1 - rss0 < 64 * 1024  # KB


@pytest.mark.gpu
def test_gpu_memory_reserved_stays_flat_over_epochs(shards):
    """One side stream for all epochs: the caching allocator's blocks are reused, not stranded per epoch."""
    import torch

    it_loader = loader(shards, device="cuda", batch_size=7, drop_last=False)
    reserved = []
    for e in range(30):
        it_loader.set_epoch(e)
        for _ in it_loader:
            pass
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[4], [r >> 20 for r in reserved]


# ---- elastic resume: a global state resumes on another world size ---------------------------------
def _elastic_run(urls, world, *, state=None, k=None, keys=True, **kwargs):
    """Labels each rank delivers (its first ``k`` batches) and the rank states after them."""
    got, states = [], []
    for rank in range(world):
        args = dict(train=True, drop_last=False, shuffle_buffer=6, rank=rank, world_size=world, **kwargs)
        dl = loader(urls, **(by_key(**args) if keys else args))  # keys: labels are the sample identities
        if state is not None:
            dl.load_state_dict(state)
        labels = []
        it = iter(dl)
        for i, (_, y) in enumerate(it):
            labels += y.tolist()
            if k is not None and i + 1 == k:
                break
        states.append(dl.state_dict())
        it.close()
        got.append(labels)
    return got, states


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2)])
def test_stream_reader_resumes_on_another_world_size(shards, old, new):
    before, states = _elastic_run(shards, old, k=2 if old == 1 else 1, reader="stream")
    g = states[0] if old == 1 else states  # one rank is the whole job; else the list of rank states
    after, _ = _elastic_run(shards, new, state=g, reader="stream")
    assert len({len(a) for a in after}) == 1  # every rank as many samples
    seen = [y for r in before + after for y in r]
    assert set(seen) == set(range(N)) and len(seen) - N <= (old - 1) + (new - 1)


def test_stream_reader_global_state_dict_without_distributed(shards):
    from datapipe.order import elastic

    dl = loader(shards, train=True, drop_last=False, shuffle_buffer=6, reader="stream", **by_key())
    it = iter(dl)
    head = [y for _, (_, ys) in zip(range(2), it) for y in ys.tolist()]
    it.close()
    g = dl.global_state_dict()
    assert elastic.is_global(g) and elastic.shape(g)["world_size"] == 1
    after, _ = _elastic_run(shards, 2, state=g, reader="stream")
    assert sorted(head + after[0] + after[1]) == list(range(N))


def test_dali_reader_global_state_same_world_is_exact(shards):
    full, _ = _elastic_run(shards, 2, keys=False, reader="dali")
    before, states = _elastic_run(shards, 2, k=1, keys=False, reader="dali")
    after, _ = _elastic_run(shards, 2, state=states, keys=False, reader="dali")
    assert [b + a for b, a in zip(before, after)] == full


def test_reader_workers_resume_on_another_world_size_and_worker_count(shards):
    before, states = _elastic_run(shards, 2, k=1, reader="stream", read_workers=1)
    after, _ = _elastic_run(shards, 1, state=states, reader="stream", read_workers=2)
    seen = before[0] + before[1] + after[0]
    assert set(seen) == set(range(N)) and len(seen) - N <= 1


def test_decode_device_is_checked(shards):
    with pytest.raises(ValueError, match="decode_device"):
        loader(shards, decode_device="tpu")
    with pytest.raises(ValueError, match="decode_device"):
        loader(shards, decode_device="gpu")  # device="cpu": nothing to decode on
    with pytest.raises(ValueError, match="num_threads"):
        loader(shards, decode_device="cpu", num_threads=0)
    assert loader(shards).decode_device == "cpu"


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "NCHW"), (torch.bfloat16, "NHWC"), (torch.uint8, "NCHW")])
def test_cpu_decode_path_gives_the_default_images(shards, dtype, layout):
    """decode_device='cpu' (uint8 HWC out of DALI, permute + cast + normalise in torch) = DALI's own normalise."""
    ref_x, ref_y = collect(loader(shards, dtype=dtype, layout=layout))
    x, y = collect(loader(shards, dtype=dtype, layout=layout, decode_device="cpu"))
    assert y.tolist() == ref_y.tolist()
    assert x.dtype == dtype and x.shape == ref_x.shape and x.is_contiguous()
    tol = 0.02 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(x.float(), ref_x.float(), atol=tol, rtol=0.01), (x.float() - ref_x.float()).abs().max()


def test_cpu_decode_path_trains_like_the_default(shards):
    """Train mode (random crop, flip): same seed, same augmentation through either path."""
    ref_x, ref_y = collect(loader(shards, train=True, seed=3))
    x, y = collect(loader(shards, train=True, seed=3, decode_device="cpu"))
    assert y.tolist() == ref_y.tolist()
    assert torch.allclose(x, ref_x, atol=1e-4)
    assert x.shape == (N // 8 * 8, 3, S, S)


@pytest.mark.gpu
def test_cpu_decode_on_cuda_matches_the_gpu_path(shards):
    ref_x, ref_y = collect(loader(shards, device="cuda"))
    cpu_decoded = loader(shards, device="cuda", decode_device="cpu")
    assert cpu_decoded.num_threads >= 1
    x, y = collect(cpu_decoded)
    assert x.is_cuda and y.is_cuda and x.dtype == torch.float32 and x.shape == ref_x.shape
    assert y.cpu().tolist() == ref_y.cpu().tolist()
    diff = (x - ref_x).abs()
    assert diff.mean() < 0.05, diff.mean()  # CPU vs GPU JPEG decoding differ slightly
    lo, hi = -max(IMAGENET_MEAN) / min(IMAGENET_STD), 1 / min(IMAGENET_STD)
    assert lo - 1e-3 <= x.min().item() and x.max().item() <= hi + 1e-3
    for dtype, layout in ((torch.bfloat16, "NCHW"), (torch.uint8, "NHWC")):
        tx, ty = collect(loader(shards, device="cuda", train=True, dtype=dtype, layout=layout, decode_device="cpu"))
        shape = (N // 8 * 8, 3, S, S) if layout == "NCHW" else (N // 8 * 8, S, S, 3)
        assert tx.is_cuda and tx.dtype == dtype and tx.shape == shape


def test_antialias_off_gives_images_of_the_same_shape_that_differ(shards):
    """``antialias=False`` changes DALI's resize filter only: same shapes and labels, other pixels."""
    (a, la), (b, lb) = (next(iter(loader(shards, antialias=aa))) for aa in (True, False))
    assert a.shape == b.shape and torch.equal(la, lb)
    assert not torch.equal(a, b)


# ---- elastic resume of DALI's reader: a delivered bitmap, the rest through ShardStream ------------
@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """Shards whose 'cls' label is the sample's own number (DALI's reader reads member labels only)."""
    out = tmp_path_factory.mktemp("numbered")
    urls = []
    for shard in range(4):
        url = str(out / f"n-{shard}.tar")
        with webdataset.TarWriter(url) as w:
            for s in iter_image_samples(10, seed=shard, num_classes=10, size=(48, 40), start=shard * 10):
                w.write({**s, "cls": str(int(s["__key__"])).encode()})
        urls.append(url)
    return urls


@pytest.mark.parametrize("old,new,k", [(2, 1, 1), (1, 2, 2), (2, 3, 2)])
def test_dali_reader_resumes_on_another_world_size(numbered, tmp_path, old, new, k):
    args = dict(keys=False, reader="dali", index_dir=str(tmp_path / "ix"))
    before, states = _elastic_run(numbered, old, k=k, **args)
    after, after_states = _elastic_run(numbered, new, state=states if old > 1 else states[0], **args)
    assert len({len(a) for a in after}) == 1  # every new rank as many samples
    seen = [y for r in before + after for y in r]
    assert sorted(set(seen)) == list(range(N))
    assert len(seen) - N <= (old - 1) + (new - 1)  # only the plans' allowed repeats
    # the rest came through ShardStream; it ran to its end: the states are the start of epoch 1, no DALI checkpoint
    assert all(s["dali"] is None and s["epoch"] == 1 and s["stream"]["workers"] == {} for s in after_states)
    # the next epoch is DALI's own again, on the new shape
    dl = loader(numbered, reader="dali", index_dir=str(tmp_path / "ix"), train=True, drop_last=False,
                rank=0, world_size=new)
    dl.load_state_dict(states if old > 1 else states[0])
    for _ in dl:
        pass
    assert dl.epoch == 1
    nxt = [y for _, ys in dl for y in ys.tolist()]
    assert len(nxt) == -(-N // new) and dl.state_dict()["dali"] is not None


def test_dali_reader_resume_mid_rest_on_yet_another_shape(numbered, tmp_path):
    """2 ranks -> 1 (one batch of the rest) -> 2: the epoch still comes out whole."""
    args = dict(keys=False, reader="dali", index_dir=str(tmp_path / "ix"))
    before, states = _elastic_run(numbered, 2, k=1, **args)
    middle, mid_states = _elastic_run(numbered, 1, state=states, k=1, **args)
    after, _ = _elastic_run(numbered, 2, state=mid_states[0], **args)
    seen = [y for r in before + middle + after for y in r]
    assert sorted(set(seen)) == list(range(N)) and len(seen) - N <= 2


def test_dali_reader_state_records_what_was_delivered(numbered, tmp_path):
    from datapipe.order import elastic

    dl = loader(numbered, reader="dali", index_dir=str(tmp_path / "ix"), train=True, drop_last=False)
    it = iter(dl)
    got = [y for _, (_, ys) in zip(range(2), it) for y in ys.tolist()]
    it.close()
    dali = dl.state_dict()["dali"]
    mask = elastic.unpack_bitmap(dali["delivered"], N)
    assert len(dali["delivered"]) == (N + 7) // 8
    # numbers are the plan's (shard order of the epoch, then sample order); map labels through it
    from datapipe.order.plan import shard_order

    order = shard_order(4, shuffle=True, seed=dl.stream.seed, epoch=dl.epoch)
    number = {shard * 10 + j: pos * 10 + j for pos, shard in enumerate(order) for j in range(10)}
    assert sorted(np.flatnonzero(mask).tolist()) == sorted(number[y] for y in got)


def test_dali_reader_foreign_or_corrupt_bitmap_is_a_clear_error(numbered, shards, tmp_path):
    args = dict(keys=False, reader="dali", index_dir=str(tmp_path / "ix"))
    _, states = _elastic_run(numbered, 2, k=1, **args)
    corrupt = [{**s, "dali": {**s["dali"], "delivered": s["dali"]["delivered"][:-1]}} for s in states]
    dl = loader(numbered, rank=0, world_size=1, **{k: v for k, v in args.items() if k != "keys"})
    with pytest.raises(ValueError, match="bitmap"):
        dl.load_state_dict(corrupt)
    not_bytes = [{**s, "dali": {**s["dali"], "delivered": [1, 0]}} for s in states]
    with pytest.raises(ValueError, match="bitmap must be bytes"):
        dl.load_state_dict(not_bytes)
    foreign = loader(shards, rank=0, world_size=1, reader="dali", index_dir=str(tmp_path / "ix2"))
    with pytest.raises(ValueError, match="other shards"):
        foreign.load_state_dict(states)



@pytest.mark.parametrize("reader", ["dali", "stream"])
@pytest.mark.parametrize("train", [False, True])
def test_a_decoder_switch_mid_epoch_loses_and_repeats_nothing(shards, reader, train):
    """hw_decoder_load="auto" rebuilds DALI's pipeline where it stopped (forced here: CPU pipelines never switch)."""

    def run(switch_at):
        labels = by_key() if reader == "stream" else {}  # DALI's reader takes a member label (cls)
        dl = loader(shards, reader=reader, train=train, batch_size=4, seed=3, **labels)
        xs, ys = [], []
        for i, (x, y) in enumerate(dl):
            if i == switch_at:
                dl._decoder.due = True  # as the consumer sets it when it waits too long
            xs.append(x)
            ys.append(y)
        return dl.stats(), torch.cat(xs), torch.cat(ys)

    plain, x0, y0 = run(None)
    switched, x1, y1 = run(1)
    assert plain["decoder"]["switches"] == 0 and switched["decoder"]["switches"] == 1
    assert len(y1) == N and y1.tolist() == y0.tolist()
    if reader == "stream":
        assert sorted(y1.tolist()) == list(range(N))  # every sample once
    if not train or reader == "dali":  # DALI's checkpoint carries its random states over; a fed pipeline reseeds
        assert torch.equal(x1, x0)
    assert switched["samples"] == N


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_a_move_and_a_move_back_mid_epoch_lose_and_repeat_nothing(shards, reader):
    """A trial that takes the move back rebuilds the pipeline a second time, where the first rebuild left off."""
    labels = by_key() if reader == "stream" else {}
    _, y0 = collect(loader(shards, reader=reader, batch_size=2, **labels))
    dl = loader(shards, reader=reader, batch_size=2, **labels)
    ys = []
    for i, (_, y) in enumerate(dl):
        if i in (1, 6):
            dl._decoder.due = True  # the move, then the trial's verdict (forced: CPU pipelines never switch)
        ys.append(y)
    decoder = dl.stats()["decoder"]
    assert decoder["switches"] == 2 and decoder["hw_decoder_load"] == 0.0  # back where it started
    assert torch.cat(ys).tolist() == y0.tolist() and dl.stats()["samples"] == N


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_gpu_auto_decoder_switches_once_when_the_consumer_waits(shards, reader):
    """A loop that does nothing but take batches waits for every one: "auto" moves to the hardware decoder."""
    from loaders.images import decoder_choice

    cpu_x, cpu_y = collect(loader(shards, reader=reader, batch_size=2))
    dl = loader(shards, device="cuda", reader=reader, batch_size=2, hw_decoder_load="auto")
    if decoder_choice.cores_per_process() < decoder_choice.MIN_CORES:
        assert dl.hw_decoder_load == decoder_choice.HARDWARE_LOAD  # few cores: the hardware decoder throughout
        return
    assert dl.hw_decoder_load == 0.0 and dl.decode.hw_decoder_load == "auto"
    x, y = collect(dl)
    decoder = dl.stats()["decoder"]
    moved_to = decoder_choice.FEW_QUEUES_LOAD if decoder["queues"] < 32 else decoder_choice.HARDWARE_LOAD
    assert decoder["switches"] == 1 and dl.hw_decoder_load == moved_to
    assert decoder["switched_after_batches"] == decoder_choice.SKIP + decoder_choice.EARLY
    assert y.cpu().tolist() == cpu_y.tolist()  # nothing lost or repeated across the rebuild
    assert (x.cpu() - cpu_x).abs().mean() < 0.05
    x2, y2 = collect(dl)  # the next epoch stays on the hardware decoder
    assert dl.stats()["decoder"]["switches"] == 1 and y2.cpu().tolist() == cpu_y.tolist()


@pytest.mark.parametrize("reader", ["dali", "stream"])
def test_a_new_pass_stops_the_last_one_first(shards, reader):
    _, ref = collect(loader(shards, reader="stream"))
    kw = dict(index_dir=os.path.join(os.path.dirname(shards[0]), "ix_passes")) if reader == "dali" else {}
    dl = loader(shards, reader=reader, **kw)
    old = iter(dl)
    next(old)  # its producer thread runs ahead on the source both passes share (the stream reader crashed)
    _, y = collect(dl)
    assert sorted(y.tolist()) == sorted(ref.tolist())
    with pytest.raises(StopIteration):
        next(old)


def test_gpu_decoding_advises_wide_hardware_queues_once(monkeypatch, caplog):
    from loaders.images import loader as image_loader

    caplog.set_level("INFO", logger="loaders.images")
    for value, warns in (("", True), ("8", True), ("32", False)):
        image_loader.advise_hardware_queues.cache_clear()
        if value:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        else:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        caplog.clear()
        assert image_loader.advise_hardware_queues() is warns
        assert image_loader.advise_hardware_queues() is warns  # cached: one line per process
        assert image_loader.advise_hardware_queues(False) is False  # the CUDA decoder: no hold, no warning
        lines = [r for r in caplog.records if "CUDA_DEVICE_MAX_CONNECTIONS=32" in r.getMessage()]
        assert [r.levelname for r in lines] == (["WARNING", "INFO"] if warns else [])
    image_loader.advise_hardware_queues.cache_clear()


@pytest.mark.parametrize("queues, device, load, active", [
    ("8", "cpu", None, False), pytest.param("8", "cuda", 0.75, True, marks=pytest.mark.gpu),
    pytest.param("8", "cuda", 0.0, False, marks=pytest.mark.gpu),
    pytest.param("32", "cuda", 0.75, False, marks=pytest.mark.gpu)])
def test_step_hold_follows_the_hardware_queues_and_decoder(shards, monkeypatch, queues, device, load, active):
    """Few queues hold next() only while the hardware decoder is in use."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", queues)
    lo = loader(shards, device=device, hw_decoder_load=load)
    x, y = collect(lo)
    hold = lo.stats()["step_hold"]
    assert hold["active"] is active
    if not active:
        assert hold["seconds"] == 0.0  # an inactive hold never waits
    assert len(y) == lo.stats()["samples"] > 0


def test_only_the_part_of_a_wait_that_leaves_the_gpu_idle_counts_as_starved():
    """The decoder choice judges waits in next() by the time the consumer's stream had nothing left to run
    (datapipe.device.idle_watch): a host that waits while its GPU still runs queued steps (CUDA graphs) starves
    nothing. A CPU device counts every wait whole; a choice that no longer watches needs no watch."""
    from types import SimpleNamespace

    from datapipe.device.idle_watch import IdleWatch
    from loaders.images.loader import ImageLoader

    def fake(device, judging=True):
        return SimpleNamespace(device=torch.device(device), _decoder=SimpleNamespace(watching_starvation=judging),
                               _consumer=lambda: None, _idle=None)

    on_gpu = fake("cuda")
    watch = ImageLoader._idle_watch(on_gpu)
    assert isinstance(watch, IdleWatch) and ImageLoader._idle_watch(on_gpu) is watch  # one per pass
    assert ImageLoader._idle_watch(fake("cpu")) is None  # no GPU: every wait starves the loop
    assert ImageLoader._idle_watch(fake("cuda", judging=False)) is None  # not judged: nothing to time


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_busy", [False, True])
def test_gpu_default_cuda_decoder_gives_way_only_when_the_gpu_starves(shards, monkeypatch, gpu_busy):
    """Few hardware queues: the default decodes on the CUDA decoder and moves to the hardware decoder when the
    loop starves; a loop that runs ahead of a busy GPU waits in next() without starving it and keeps it."""
    from loaders.images import decoder_choice

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    dl = loader(shards, device="cuda", reader="dali", batch_size=2, num_threads=None)
    if decoder_choice.cores_per_process() < decoder_choice.MIN_CORES:
        pytest.skip("fewer than 12 cores: the default keeps the hardware decoder")
    assert dl.hw_decoder_load == 0.0 and dl.stats()["decoder"]["switchable"]
    ys = []
    for _, y in dl:
        ys.append(y)
        if gpu_busy:
            torch.cuda._sleep(50_000_000)  # ~25 ms of one thread block on the consumer's stream: the host runs ahead
    torch.cuda.synchronize()
    decoder = dl.stats()["decoder"]
    assert decoder["switches"] == (0 if gpu_busy else 1)
    assert dl.stats()["step_hold"]["active"] is (not gpu_busy)  # the hardware decoder on 8 queues holds next()
    assert torch.cat(ys).numel() == dl.stats()["samples"] == N


@pytest.mark.parametrize("drop, missing", [("cls", "a 'cls' label"), ("jpg", "an image")])
def test_dali_reader_names_a_sample_without_an_entry_it_needs(tmp_path, drop, missing):
    """A sample without its label (or its image) makes DALI's reader fail: the error names the sample and the entry."""
    samples = list(iter_image_samples(6, seed=9, num_classes=10, size=(96, 72)))
    samples[4] = {k: v for k, v in samples[4].items() if k != drop}
    tar = str(tmp_path / "shard-000000.tar")
    with webdataset.TarWriter(tar) as w:
        for s in samples:
            w.write(s)
    with pytest.raises(DataError) as e:
        list(loader([tar], batch_size=2, reader="dali", index_dir=str(tmp_path / "ix")))
    assert e.value.key == samples[4]["__key__"] and missing in str(e.value) and "shard-000000.tar" in str(e.value)


@pytest.mark.parametrize("read_workers", [0, 1])
def test_a_rank_state_taken_before_its_first_batch_joins_a_global_state(shards, read_workers):
    """One rank saved its state after iter() but before any batch (frameworks make the iterator first): the list
    of rank states still resumes the epoch on another shape, every sample once."""
    got, states = [], []
    for rank, k in ((0, 0), (1, 1)):
        dl = loader(shards, reader="stream", read_workers=read_workers,
                    **by_key(train=True, drop_last=False, shuffle_buffer=6, rank=rank, world_size=2))
        it = iter(dl)
        got += [y for _, (_, ys) in zip(range(k), it) for y in ys.tolist()]
        states.append(dl.state_dict())
        it.close()
    after, _ = _elastic_run(shards, 1, state=states, reader="stream", read_workers=read_workers)
    seen = got + after[0]
    assert set(seen) == set(range(N)) and len(seen) - N <= 1


@pytest.mark.parametrize("read_workers", [0, 1])
def test_a_state_taken_before_the_first_batch_resumes_the_whole_epoch(shards, read_workers):
    kw = by_key(train=True, drop_last=False, shuffle_buffer=6)
    _, full = collect(loader(shards, reader="stream", read_workers=read_workers, **kw))
    dl = loader(shards, reader="stream", read_workers=read_workers, **kw)
    it = iter(dl)
    state = dl.state_dict()
    it.close()
    again = loader(shards, reader="stream", read_workers=read_workers, **kw)
    again.load_state_dict(state)
    _, rest = collect(again)
    assert rest.tolist() == full.tolist()
