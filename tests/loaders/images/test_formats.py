"""ImageLoader reads every image type `datapipe shard` writes (JPEG, PNG, WebP, BMP, TIFF, PNM; GIF through the
stream reader), on both readers, on DALI's CPU pipelines."""
import io
import logging
import os

import numpy as np
import pytest
import torch
import webdataset
from PIL import Image

pytest.importorskip("nvidia.dali")

from datapipe.cli import main  # noqa: E402
from datapipe.errors import DataError  # noqa: E402
from datapipe.image_bytes import IMAGE_ENTRIES  # noqa: E402
from datapipe.jobs.shard.listing import IMAGE_EXTENSIONS as SHARD_JOB_EXTENSIONS  # noqa: E402
from datapipe.stream import ShardStream  # noqa: E402
from loaders.images.loader import ImageLoader  # noqa: E402
from loaders.images.options import ReadOptions  # noqa: E402

S = 16
FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "tiff": "TIFF", "ppm": "PPM", "gif": "GIF"}


def colour(label: int) -> tuple[int, int, int]:
    return (40 + 50 * (label % 4), 230 - 60 * (label % 3), 25 * (label % 7))


def encoded(ext: str, label: int) -> bytes:
    """A flat image of the label's colour, as PIL writes ``ext``."""
    buf = io.BytesIO()
    im = Image.new("RGB", (40, 30), colour(label))
    (im.quantize(8) if ext == "gif" else im).save(buf, format=FORMATS[ext])
    return buf.getvalue()


def write_shard(path, exts, *, per_ext=3, start=0):
    """A shard with ``per_ext`` samples of each extension in turn; ``cls`` numbers the samples from ``start``."""
    label = start
    with webdataset.TarWriter(str(path)) as w:
        for _ in range(per_ext):
            for ext in exts:
                w.write({"__key__": f"{label:05d}", ext: encoded(ext, label), "cls": str(label).encode()})
                label += 1
    return str(path)


def read_all(source, **read):
    """Every (label, mean RGB) of one eval epoch, uint8 pixels, on the CPU; and the loader."""
    dl = ImageLoader(source, batch_size=4, image_size=S, train=False, device="cpu", dtype=torch.uint8,
                     read=ReadOptions(**read))
    out = {}
    for images, labels in dl:
        for image, label in zip(images, labels.tolist()):
            assert label not in out, f"sample {label} twice"
            out[label] = image.float().mean(dim=(1, 2)).numpy()
    return out, dl


def assert_colours(seen, labels, tol=6):
    assert sorted(seen) == sorted(labels)
    for label in labels:
        assert np.abs(seen[label] - np.array(colour(label))).max() <= tol, (label, seen[label], colour(label))


def test_the_default_image_entries_cover_every_type_the_shard_job_writes():
    written = set(SHARD_JOB_EXTENSIONS) | set(SHARD_JOB_EXTENSIONS.values())
    assert written <= set(ReadOptions().image_exts) == set(IMAGE_ENTRIES)
    assert ReadOptions(image_exts="webp;png").image_exts == ("webp", "png")  # webdataset's spelling


@pytest.mark.parametrize("reader", ["stream", "dali"])
@pytest.mark.parametrize("ext", ["jpg", "png", "webp"])
def test_each_common_type_is_read_by_both_readers(tmp_path, reader, ext):
    path = write_shard(tmp_path / f"{ext}.tar", [ext], per_ext=6)
    seen, dl = read_all(path, reader=reader)
    assert dl.reader == reader
    assert_colours(seen, range(6))
    assert dl.stats()["skipped"] == 0 and dl.stats()["decode_errors"] == 0


def test_webp_under_skip_is_read_not_skipped(tmp_path):
    path = write_shard(tmp_path / "webp.tar", ["webp"], per_ext=5)
    dl = ImageLoader(ShardStream(path, on_error="skip"), batch_size=4, image_size=S, train=False, device="cpu")
    assert sum(len(y) for _, y in dl) == 5
    assert dl.stats()["skipped"] == 0


@pytest.mark.parametrize("reader", ["stream", "dali"])
def test_a_mixed_shard_of_every_type_dali_decodes(tmp_path, reader):
    exts = ["jpg", "png", "webp", "bmp", "tiff", "ppm"]
    paths = [write_shard(tmp_path / "a.tar", exts, per_ext=2), write_shard(tmp_path / "b.tar", exts[::-1], start=12)]
    seen, dl = read_all(paths, reader=reader)
    assert dl.reader == reader
    assert_colours(seen, range(12 + 18))


def test_gif_is_reencoded_by_the_stream_reader_and_auto_takes_it(tmp_path, caplog):
    path = write_shard(tmp_path / "mixed.tar", ["jpg", "gif", "webp"], per_ext=3)
    with caplog.at_level(logging.INFO, logger="loaders.images"):
        seen, dl = read_all(path)  # reader="auto" on local shards with on_error="raise": DALI's, but for the GIFs
    assert dl.reader == "stream" and "GIF" in caplog.text
    assert_colours(seen, range(9), tol=12)  # a GIF's palette is near, not exact
    seen, dl = read_all(path, reader="stream", read_workers=1)  # the workers re-encode too
    assert_colours(seen, range(9), tol=12)


def test_dali_reader_refuses_gif_by_name(tmp_path):
    path = write_shard(tmp_path / "mixed.tar", ["jpg", "gif"], per_ext=2)
    with pytest.raises(ValueError, match=r"GIF.*mixed\.tar.*00001\.gif.*reader='stream'"):
        ImageLoader(path, batch_size=2, image_size=S, device="cpu", read=ReadOptions(reader="dali"))
    # without "gif" among the image entries, a GIF-only sample is a sample without an image, named
    dl = ImageLoader(ShardStream(path, on_error="skip"), batch_size=2, image_size=S, train=False, device="cpu",
                     read=ReadOptions(image_exts=("jpg",)))
    assert sum(len(y) for _, y in dl) == 2 and dl.stats()["skipped"] == 2
    assert "no image entry" in dl.stats()["last_errors"][0]


def test_broken_gif_and_truncated_webp_are_named_and_counted(tmp_path):
    gif, webp = encoded("gif", 1), encoded("webp", 2)
    path = str(tmp_path / "bad.tar")
    with webdataset.TarWriter(path) as w:
        w.write({"__key__": "good", "png": encoded("png", 0), "cls": b"0"})
        w.write({"__key__": "cutgif", "gif": gif[:14], "cls": b"1"})
        w.write({"__key__": "cutwebp", "webp": webp[: len(webp) // 2], "cls": b"2"})
    with pytest.raises(DataError, match="cutgif"):
        list(ImageLoader(path, batch_size=4, image_size=S, train=False, device="cpu",
                         read=ReadOptions(reader="stream")))
    dl = ImageLoader(ShardStream(path, on_error="skip"), batch_size=4, image_size=S, train=False, device="cpu")
    assert sum(len(y) for _, y in dl) == 1 and dl.stats()["skipped"] == 2
    errors = " ".join(dl.stats()["last_errors"])
    assert "GIF" in errors and "truncated WebP" in errors


def test_a_folder_of_jpeg_png_webp_and_gif_photos_through_the_shard_job(tmp_path):
    """The new user's path: photos of every type in class folders -> `datapipe shard` -> ImageLoader, nothing lost."""
    src = tmp_path / "photos"
    n = 0
    for cls in ("cat", "dog"):
        os.makedirs(src / cls)
        for ext in ("jpg", "png", "webp", "gif"):
            for i in range(2):
                (src / cls / f"{ext}{i}.{ext}").write_bytes(encoded(ext, n))
                n += 1
    assert main(["shard", str(src), str(tmp_path / "shards"), "--no-progress"]) == 0
    dl = ImageLoader(ShardStream(str(tmp_path / "shards"), on_error="skip"), batch_size=4, image_size=S, train=False,
                     device="cpu")
    labels = [y for _, ys in dl for y in ys.tolist()]
    assert len(labels) == n and sorted(set(labels)) == [0, 1] and dl.stats()["skipped"] == 0
