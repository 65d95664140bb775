"""Sequence packing for LLM training: algorithms and the packed-batch format (numpy; torch optional)."""
from importlib import import_module

_EXPORTS = {
    "pack_lengths": "packing.algorithms",
    "Packer": "packing.packer",
    "TokenBudgetBatcher": "packing.dynamic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packing' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
