"""Per-sample steps of a ``ShardStream``: decoding by extension (webdataset's rules) and user maps.

A raw sample is a dict ``{"__key__": "000017", "__url__": "shards/shard-000001.tar", "jpg": b"...",
"cls": b"7"}``: one ``bytes`` value per extension. :class:`Decode` turns values into Python objects by
the last part of their extension (``"seg.png"`` decodes as ``png``): images (``jpg``, ``jpeg``, ``png``,
``webp``, ...) as PIL RGB images (``"pil"``), numpy ``uint8`` HWC arrays (``"rgb8"``) or ``uint8`` CHW
tensors (``"torch"``); always ``cls`` / ``cls2`` / ``index`` / ``id`` -> ``int``, ``txt`` -> ``str``,
``json`` -> the decoded object, ``npy`` -> a numpy array. Other values stay bytes.
:func:`image_of` takes a sample's image whatever its extension (``jpg``, ``png``, ``webp``, ...).
:class:`Map` applies a user function. :func:`run_steps` runs a chain of them on one sample and turns
a failure into a ``DataError`` naming the shard and key, which the stream hands to its ``on_error``.
"""
from __future__ import annotations

import io
import json
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

from datapipe.errors import DataError
from datapipe.image_bytes import IMAGE_ENTRIES
from datapipe.storage.urls import redact_url

IMAGE_EXTENSIONS = frozenset(IMAGE_ENTRIES)
INT_EXTENSIONS = frozenset({"cls", "cls2", "index", "id"})
IMAGE_FORMATS = ("pil", "rgb8", "torch")
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")  # "<_io.BytesIO object at 0x7f...>" says nothing


def _text(value) -> str:
    return bytes(value).decode("utf-8")


def _image(value, images: str):
    from PIL import Image

    data = bytes(value)
    if not data:
        raise ValueError("empty file where an image was expected")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError as e:
        raise ValueError("not a decodable image (PIL: cannot identify image file)") from e
    with img:
        img = img.convert("RGB")
    if images == "pil":
        return img
    import numpy as np

    array = np.asarray(img, dtype=np.uint8)
    if images == "rgb8":
        return array
    import torch

    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _npy(value):
    import numpy as np

    return np.load(io.BytesIO(bytes(value)), allow_pickle=False)


def decode_value(extension: str, value: Any, *, images: str = "pil") -> Any:
    """``value`` decoded by the last part of ``extension`` (see the module docstring); other values as given."""
    ext = extension.rsplit(".", 1)[-1].lower()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        return value  # decoded already (or not bytes at all)
    if ext in IMAGE_EXTENSIONS:
        return _image(value, images)
    if ext in INT_EXTENSIONS:
        return int(_text(value).strip())
    if ext == "txt":
        return _text(value)
    if ext == "json":
        return json.loads(_text(value))
    if ext == "npy":
        return _npy(value)
    return value


def image_of(sample: dict, exts: str | Sequence[str] = IMAGE_ENTRIES) -> Any:
    """The sample's image, whatever its extension: the value of the first entry of ``exts`` it has.

    Decoded or not (use it after ``.decode()`` or on raw samples). ``exts``: entry names in the order they
    are tried, a sequence or webdataset's ``"jpg;png;webp"``; default: every image type ``datapipe shard``
    writes (:data:`datapipe.image_bytes.IMAGE_ENTRIES`). A sample with none of them raises ``ValueError``
    naming the entries it has (inside ``.map()``: a ``DataError`` naming its shard and key, under ``on_error``).
    """
    names = exts.split(";") if isinstance(exts, str) else exts
    for name in names:
        if name in sample:
            return sample[name]
    raise ValueError(f"the sample has no image entry ({';'.join(names)}); its entries are "
                     f"{sorted(k for k in sample if not k.startswith('__'))}")


class Decode:
    """The step ``stream.decode(images)``: every value of a sample dict decoded by its extension.

    Args:
        images: ``"pil"`` (PIL RGB images), ``"rgb8"`` (numpy uint8 HWC) or ``"torch"`` (uint8 CHW tensors).
    """

    def __init__(self, images: str = "pil"):
        if images not in IMAGE_FORMATS:
            raise ValueError(f"decode(images) takes one of {IMAGE_FORMATS}, got {images!r}")
        self.images = images
        self.name = f"decode({images!r})"

    def __call__(self, sample: Any) -> Any:
        if not isinstance(sample, dict):
            raise TypeError(f"decode needs a sample dict, got {type(sample).__name__}: call decode() before a "
                            "map() that changes the sample's type")
        out = {}
        for key, value in sample.items():
            if key.startswith("__"):
                out[key] = value
                continue
            try:
                out[key] = decode_value(key, value, images=self.images)
            except Exception as e:
                what = "image " if key.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS else ""
                raise ValueError(f"cannot decode {what}{key!r}: {_OBJECT_REPR.sub('', str(e))}") from e
        return out


class Map:
    """The step ``stream.map(fn)``: ``fn(sample)`` (the sample as the previous step left it)."""

    def __init__(self, fn: Callable[[Any], Any]):
        if not callable(fn):
            raise ValueError(f"map(fn) needs a callable, got {type(fn).__name__} {fn!r}")
        self.fn = fn
        self.name = f"map({getattr(fn, '__qualname__', type(fn).__name__)})"

    def __call__(self, sample: Any) -> Any:
        return self.fn(sample)


def run_steps(steps: Sequence[Callable[[Any], Any]], sample: dict) -> Any:
    """``sample`` through ``steps`` in order; a failure is a ``DataError`` naming the shard, key and step."""
    out = sample
    for step in steps:
        try:
            out = step(out)
        except Exception as e:
            url = sample.get("__url__")
            raise DataError(f"{getattr(step, 'name', 'step')} failed: {type(e).__name__}: {e}",
                            url=redact_url(url) if isinstance(url, str) else None,
                            key=sample.get("__key__")) from e
    return out


def stepped(items: Iterable[Any], steps: Sequence[Callable[[Any], Any]], *, lost: Any,
            lose: Callable[[DataError, int], Iterable[Any]]) -> Iterator[Any]:
    """The steps stage: each sample through ``steps``; one that fails goes to ``lose(error, 1)`` (the
    ``on_error`` policy, which raises or gives a ``lost`` item in its place)."""
    for item in items:
        if item is lost:
            yield item
            continue
        try:
            out = run_steps(steps, item)
        except DataError as e:
            yield from lose(e, 1)
            continue
        yield out
