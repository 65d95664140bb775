"""datapipe: keeps GPUs fed.

Sharded WebDataset streaming from any fsspec storage, shard writing, pinned-memory device
prefetch: the engine. The preprocessing jobs live in ``datapipe.jobs``, the benchmarks, doctor and
other tools in ``datapipe.tools``. Public names are imported lazily so that
``import datapipe`` stays cheap and never pulls in DALI, Ray or s3fs.
"""
from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "DataError": "datapipe.errors",
    "expand_urls": "datapipe.storage.urls",
    "redact_url": "datapipe.storage.urls",
    "ShardStream": "datapipe.stream",
    "StorageOptions": "datapipe.read.options",
    "ShardWriter": "datapipe.tar.writer",
    "read_manifest": "datapipe.tar.manifest",
    "DevicePrefetcher": "datapipe.device.prefetch",
    "mix": "datapipe.order.mixing",
    "write_dali_index": "datapipe.tar.dali_index",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'datapipe' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
