"""datapipe: keeps GPUs fed.

Sharded WebDataset streaming from any fsspec storage, shard writing, pinned-memory device
prefetch, preprocessing jobs and throughput benchmarks. Public names are imported lazily so that
``import datapipe`` stays cheap and never pulls in DALI, Ray or s3fs.
"""
from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "DataError": "datapipe.errors",
    "expand_urls": "datapipe.urls",
    "redact_url": "datapipe.urls",
    "ShardStream": "datapipe.stream",
    "ShardWriter": "datapipe.writer",
    "read_manifest": "datapipe.manifest",
    "DevicePrefetcher": "datapipe.prefetch",
    "mix": "datapipe.mixing",
    "make_image_dataset": "datapipe.synthetic",
    "write_dali_index": "datapipe.dali_index",
    "doctor": "datapipe.starvation",
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
