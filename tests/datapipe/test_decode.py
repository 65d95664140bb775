"""stream.decode(...) / stream.map(fn): per-sample steps that run where samples are read, under on_error."""
import io
import json
import os

import numpy as np
import pytest
import torch
import webdataset
from PIL import Image

import loaders
from datapipe import DataError, ShardStream
from datapipe.decode import Decode, decode_value, image_of
from tests.resume import assert_resumes_identically
from tests.shards import write_shards


def _image_bytes(i, fmt="JPEG"):
    buf = io.BytesIO()
    Image.new("RGB", (8 + i % 3, 6), (i * 20 % 256, 10, 200)).save(buf, format=fmt)
    return buf.getvalue()


def image_shards(directory, counts, *, bad=()):
    """Shards of images with a class, text, json and npy entry; keys in ``bad`` get broken JPEG bytes."""
    os.makedirs(directory, exist_ok=True)
    urls, n = [], 0
    for s, count in enumerate(counts):
        path = os.path.join(directory, f"shard-{s:06d}.tar")
        with webdataset.TarWriter(path) as w:
            for _ in range(count):
                key = f"{n:06d}"
                arr = io.BytesIO()
                np.save(arr, np.arange(3) + n)
                w.write({"__key__": key, "jpg": b"not a jpeg" if key in bad else _image_bytes(n),
                         "seg.png": _image_bytes(n, "PNG"), "cls": str(n % 5).encode(),
                         "txt": f"caption {n}".encode(), "json": json.dumps({"n": n}).encode(),
                         "npy": arr.getvalue(), "bin": b"\x00\x01"})
                n += 1
        urls.append(path)
    return urls


def test_decode_value_rules():
    assert decode_value("cls", b" 7\n") == 7
    assert decode_value("id", b"12") == 12
    assert decode_value("txt", b"h\xc3\xa9") == "h\u00e9"
    assert decode_value("json", b'{"a": [1]}') == {"a": [1]}
    assert decode_value("bin", b"xy") == b"xy"
    img = decode_value("seg.png", _image_bytes(1, "PNG"), images="pil")
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (9, 6)
    assert decode_value("jpg", _image_bytes(1), images="rgb8").shape == (6, 9, 3)
    t = decode_value("jpeg", _image_bytes(1), images="torch")
    assert t.dtype == torch.uint8 and t.shape == (3, 6, 9)
    with pytest.raises(ValueError, match="decode"):
        Decode("jpeg")
    with pytest.raises(ValueError, match="empty file"):
        Decode("pil")({"__key__": "k", "jpg": b""})


def test_decode_and_map_through_dataloader_workers(tmp_path):
    urls = image_shards(tmp_path, [5, 4, 3])
    raw = ShardStream(urls)
    stream = raw.decode("torch").map(lambda s: (s["jpg"], s["cls"], s["txt"], s["json"]["n"], int(s["npy"][0])))
    assert raw._steps == () and len(stream) == len(raw) == 12
    assert stream.state_dict()["workers"] == raw.state_dict()["workers"]
    got = list(loaders.DataLoader(stream, batch_size=None, num_workers=2))
    assert sorted(n for *_, n, _ in got) == list(range(12))
    for img, cls, txt, n, first in got:
        assert img.dtype == torch.uint8 and img.shape[0] == 3
        assert cls == n % 5 and txt == f"caption {n}" and first == n
    pil = next(iter(ShardStream(urls).decode("pil")))
    assert isinstance(pil["jpg"], Image.Image) and isinstance(pil["seg.png"], Image.Image)
    assert pil["bin"] == b"\x00\x01" and pil["__key__"] == "000000"
    assert isinstance(next(iter(ShardStream(urls).decode("rgb8")))["jpg"], np.ndarray)


def test_replace_keeps_the_steps(tmp_path):
    urls = image_shards(tmp_path, [3])
    stream = ShardStream(urls).decode().map(lambda s: s["cls"]).replace(shuffle=True, seed=3)
    assert sorted(stream) == [0, 1, 2]


def test_decode_failure_follows_on_error(tmp_path, caplog):
    urls = image_shards(tmp_path, [4, 4], bad={"000002"})
    with pytest.raises(DataError) as e:
        list(ShardStream(urls).decode("pil"))
    assert e.value.key == "000002" and e.value.url.endswith("shard-000000.tar")
    assert "decode" in str(e.value) and e.value.__cause__ is not None
    # it says what the bytes are without PIL's "<_io.BytesIO object at 0x7f...>", and what to do (#44)
    assert "cannot decode image 'jpg': not a decodable image (PIL: cannot identify image file)" in str(e.value)
    assert " at 0x" not in str(e.value) and "BytesIO" not in str(e.value)
    assert 'on_error="skip"' in str(e.value) and "datapipe shard --check-images decode" in str(e.value)
    stream = ShardStream(urls, on_error="skip").decode("pil")
    assert [s["cls"] for s in stream] == [0, 1, 3, 4, 0, 1, 2]
    assert stream.stats()["skipped"] == 1 and stream.stats()["errors"] == 1


def _fails_on_three(sample):
    if sample["cls"] == 3:
        raise RuntimeError("no threes")
    return sample["cls"]


def test_map_failure_is_a_data_error_counted_under_skip(tmp_path):
    urls = image_shards(tmp_path, [5])
    with pytest.raises(DataError, match="no threes") as e:
        list(ShardStream(urls).decode().map(_fails_on_three))
    assert e.value.key == "000003"
    stream = ShardStream(urls, on_error="warn").decode().map(_fails_on_three)
    assert list(stream) == [0, 1, 2, 4]
    assert stream.stats()["skipped"] == 1
    # under DDP the lost sample is padded so that ranks stay equal
    ranks = [list(ShardStream(urls, on_error="skip", rank=r, world_size=2).decode().map(_fails_on_three))
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3


def test_steps_resume_identically(tmp_path):
    urls = image_shards(tmp_path, [4, 3])
    assert_resumes_identically(lambda: ShardStream(urls, shuffle=True, shuffle_buffer=3).decode("rgb8")
                               .map(lambda s: (s["__key__"], s["cls"])))


def test_cpu_training_example(tmp_path):
    """The 10-line example of the docs: decode, augment with plain torch ops, collate, one model step."""
    image_shards(tmp_path / "shards", [8, 8])
    urls = str(tmp_path / "shards" / "shard-{000000..000001}.tar")

    def to_pair(s):
        img = s["jpg"][:, :6, :8].float() / 255  # crop to 6x8, scale to [0, 1]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)  # random horizontal flip
        return img, s["cls"]

    stream = ShardStream(urls, shuffle=True, shuffle_buffer=8).decode("torch").map(to_pair)
    loader = loaders.DataLoader(stream, batch_size=4, num_workers=2)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 8, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for images, labels in loader:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad(), loss.backward(), opt.step()
    assert loader.stats()["samples"] == 16 and torch.isfinite(loss)


def _image_and_class(sample):
    return image_of(sample).size, sample["cls"]


def test_image_of_takes_the_image_whatever_its_extension(tmp_path):
    """jpg, png and webp samples in one shard: `.decode("pil").map(...)` with image_of reads them all."""
    path = str(tmp_path / "mixed.tar")
    with webdataset.TarWriter(path) as w:
        for i, fmt in enumerate(["JPEG", "PNG", "WEBP", "BMP", "TIFF", "GIF"]):
            ext = {"JPEG": "jpg", "TIFF": "tiff"}.get(fmt, fmt.lower())
            w.write({"__key__": f"{i:03d}", ext: _image_bytes(i, fmt), "cls": str(i).encode()})
    got = list(ShardStream(path).decode("pil").map(_image_and_class))
    assert got == [((8 + i % 3, 6), i) for i in range(6)]
    raw = next(iter(ShardStream(path)))
    assert bytes(image_of(raw)) == bytes(raw["jpg"])  # raw samples too
    sample = {"__key__": "k", "png": 1, "webp": 2, "cls": 0}
    assert image_of(sample) == 1 and image_of(sample, "webp;png") == 2 and image_of(sample, ["webp"]) == 2
    with pytest.raises(ValueError, match=r"no image entry \(jpg;jpeg\); its entries are \['cls', 'png', 'webp'\]"):
        image_of(sample, "jpg;jpeg")
    with pytest.raises(DataError, match="no image entry") as e:  # inside map: named, under on_error
        list(ShardStream(path).map(lambda s: image_of(s, "jpg")))
    assert e.value.key == "001"
