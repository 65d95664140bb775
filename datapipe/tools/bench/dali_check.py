"""Whether the hand-written DALI baseline can read shards: a cheap look at the images it would decode.

DALI's CPU image decoder can take the whole process down (a segfault, with no Python error and the output
lost) when a batch holds an image it cannot decode: a GIF, an empty entry, bytes that are no image, a
file cut short. ImageLoader looks at every image before DALI does and counts what it drops; the baseline is
the graph a user writes by hand, so ``datapipe bench loader`` checks its input first and refuses its row,
counted, instead of crashing the comparison.
"""
from __future__ import annotations

from collections import Counter

from datapipe.tools.bench.baselines import DALI_EXTS, IMAGE_EXTS
from datapipe.words import counted


class PipelineRefused(ValueError):
    """A pipeline the benchmark will not run on this data: the message says why; ``fields`` go into its row."""

    def __init__(self, message: str, **fields):
        super().__init__(message)
        self.fields = fields


def dali_problem(sample: dict) -> str | None:
    """Why DALI's decoder cannot take this sample's image (``"gif"``, ``"empty file"``, ...), or None."""
    from loaders.images.encoded import image_problem

    data = next((sample[e] for e in DALI_EXTS if e in sample), None)
    if data is None:
        return next((e for e in IMAGE_EXTS if e in sample), "no image entry")
    problem = image_problem(data)
    if problem is None:  # a right signature before a header no decoder parses (DALI crashes on it too)
        import io

        from PIL import Image

        try:
            Image.open(io.BytesIO(bytes(data))).size
        except Exception:  # PIL raises many types for damaged headers
            return "damaged header"
    return problem


def check_dali_input(urls: list[str], *, limit: int) -> int:
    """Look at the first ``limit`` samples in shard order (what an eval DALI reader decodes first).

    Returns how many were looked at; raises :class:`PipelineRefused` naming the count, the reasons and
    the first sample (key and shard) when any of them would reach DALI's decoder undecodable.
    """
    from datapipe.stream import ShardStream

    checked, reasons, first = 0, Counter(), None
    for sample in ShardStream(urls, rank=0, world_size=1):
        if checked >= limit:
            break
        checked += 1
        problem = dali_problem(sample)
        if problem is not None:
            reasons[problem] += 1
            first = first or (sample["__key__"], sample["__url__"])
    if reasons:
        n = sum(reasons.values())
        why = ", ".join(f"{k}: {v}" for k, v in reasons.most_common())
        raise PipelineRefused(
            f"refused: {n} of the {counted(checked, 'sample')} it would read hold an image DALI's decoder cannot take "
            f"({why}; first {first[0]!r} in {first[1]}); DALI's CPU decoder crashes the process on them. "
            f"The other rows read them (ImageLoader re-encodes GIF; damaged images follow its on_error)",
            refused_samples=n, checked_samples=checked, refused_reasons=dict(reasons))
    return checked
