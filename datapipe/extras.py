"""Optional dependencies (setup.cfg's extras) and the one error that names the extra to install.

``require("ray", what="--engine ray")`` imports and returns the module, or raises
:class:`MissingExtra`: ``--engine ray needs the extra ray: pip install 'datapipe[ray]'``.
"""
from __future__ import annotations

from importlib import import_module
from types import ModuleType

# top-level module -> the extra that installs it
EXTRAS = {
    "nvidia.dali": "dali",
    "ray": "ray",
    "s3fs": "s3",
    "skimage": "synthetic",
    "transformers": "text",
    "tokenizers": "text",
    "pyarrow": "text",
}


# URL protocol -> the module that fsspec needs for it
PROTOCOLS = {"s3": "s3fs", "s3a": "s3fs"}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def missing_extra(module: str, *, what: str) -> MissingExtra:
    """The error for ``what`` needing ``module`` (a key of :data:`EXTRAS`)."""
    extra = EXTRAS[module]
    return MissingExtra(f"{what} needs the extra {extra}: pip install 'datapipe[{extra}]'", name=module)


def require(module: str, *, what: str) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRAS`, or a submodule of one) or raise :class:`MissingExtra`.

    Args:
        module: the dotted module name, e.g. ``"nvidia.dali"``, ``"skimage.data"``.
        what: what needs it, as the user knows it (``"ImageLoader"``, ``"--engine ray"``).
    """
    root = next((m for m in EXTRAS if module == m or module.startswith(m + ".")), None)
    if root is None:
        raise ValueError(f"{module!r} is not an optional dependency of datapipe (known: {', '.join(EXTRAS)})")
    try:
        return import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing and not (missing == root or missing.startswith(root + ".") or root.startswith(missing + ".")):
            raise  # the extra is there; something it needs is broken: show that error as it is
        raise missing_extra(root, what=what) from e


def for_url(url: str, error: ImportError) -> ImportError:
    """The error to raise when fsspec cannot import the filesystem of ``url``: :class:`MissingExtra` for a
    protocol an extra provides, else ``error`` itself."""
    protocol = url.split("://", 1)[0] if "://" in url else ""
    module = PROTOCOLS.get(protocol)
    return missing_extra(module, what=f"{protocol}:// URLs") if module else error
