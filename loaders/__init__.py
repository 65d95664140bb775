"""What users construct: DataLoader (drop-in), ImageLoader (DALI), TokenLoader (packed LLM batches)."""
from importlib import import_module

_EXPORTS = {
    "DataLoader": "loaders.dataloader",
    "ImageLoader": "loaders.images.loader",
    "TokenLoader": "loaders.tokens",
    # the loaders' option groups
    "AugmentOptions": "loaders.images.options",
    "DecodeOptions": "loaders.images.options",
    "ReadOptions": "loaders.images.options",
    "DocumentOptions": "loaders.tokens.options",
    "PackOptions": "loaders.tokens.options",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loaders' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
