"""Runs every ```python block of README.md and docs/*.md, so that the examples users copy work.

Conventions (also stated in docs/index.md):

- Every fenced block whose language is ``python`` (or ``py``, ``python3``) runs; other blocks
  (``bash``, tables, output) do not.
- The blocks of one page run in order in one namespace, so a page can build on its earlier
  blocks. A block's test first runs the earlier blocks of its page that have not run yet.
- They run on the CPU, in a folder of their own per page (its current directory) holding tiny
  real data, described by ``DATA`` below: image shards made with ``datapipe.tools.synthetic``,
  token shards, an image folder and a JSONL text file, all written by the library's own writers.
- A block that needs a GPU or a remote store is skipped only when the line right before its
  opening fence (blank lines allowed between) is ``<!-- doctest: skip (REASON) -->``, REASON
  naming what it needs (CUDA, a GPU, a remote store, S3, ...). Skipped blocks are reported by
  pytest one by one with that reason, and counted; a block without the marker must run. A marker
  with no Python block after it, or with another reason, fails ``test_skip_markers``.
"""
from __future__ import annotations

import gc
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

DATA = {
    "shards/shard-{000000..000003}.tar": "64 ImageNet-like JPEGs, 16 a shard: jpg, cls (10 classes); manifest.json",
    "more-shards/shard-{000000..000001}.tar": "32 more such JPEGs, 16 a shard; manifest.json",
    "tokens/shard-{000000..000001}.tar": "40 token documents of 5-300 int32 tokens (npy); manifest.json",
    "photos/{cat,dog}/*.jpg": "an image folder, 6 JPEGs per class sub-folder",
    "text.jsonl": '20 lines {"text": ...}',
}

SKIP_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->\s*$")
SKIP_REASONS = re.compile(r"cuda|gpu|remote|s3|gcs|gs://|network|credential", re.IGNORECASE)
MARKER_PREFIX = re.compile(r"^\s*<!--\s*doctest", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
PYTHON = {"python", "py", "python3"}


@dataclass(frozen=True)
class Block:
    page: Path
    index: int  # among the page's Python blocks
    line: int  # of the opening fence, 1-based
    source: str
    skip: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The page's Python blocks, and its markers that precede no Python block: (line, text)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, stray = [], []
    pending = None  # (line, reason) of a marker waiting for its block
    i = 0
    while i < len(lines):
        text = lines[i]
        fence = FENCE.match(text)
        if fence:
            indent, ticks, lang = len(fence["indent"]), fence["ticks"], fence["lang"].lower()
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(ticks):
                line = lines[j]
                body.append(line[min(indent, len(line) - len(line.lstrip())):])  # the fence's indent off
                j += 1
            if lang in PYTHON:
                blocks.append(Block(page, len(blocks), i + 1, "\n".join(body) + "\n",
                                    pending[1] if pending else None))
            elif pending:
                stray.append((pending[0], lines[pending[0] - 1]))
            pending = None
            i = j + 1
            continue
        marker = SKIP_MARKER.match(text)
        if marker:
            if pending:
                stray.append((pending[0], lines[pending[0] - 1]))
            pending = (i + 1, marker["reason"].strip())
        elif MARKER_PREFIX.search(text):
            stray.append((i + 1, text))  # a doctest comment this test does not understand
        elif text.strip() and pending:
            stray.append((pending[0], lines[pending[0] - 1]))
            pending = None
        i += 1
    if pending:
        stray.append((pending[0], lines[pending[0] - 1]))
    return blocks, stray


BLOCKS = [b for page in PAGES for b in parse(page)[0]]


# --- the data the examples run on ---------------------------------------------------------------

def _write_npy_docs(directory: Path) -> None:
    import numpy as np

    from datapipe import ShardWriter

    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    with ShardWriter(str(directory / "shard-%06d.tar"), max_count=20) as writer:
        for i in range(40):
            buf = io.BytesIO()
            np.save(buf, rng.integers(1, 1000, size=int(rng.integers(5, 300)), dtype=np.int32))
            writer.write({"__key__": f"doc{i:06d}", "npy": buf.getvalue()})


def _write_photos(directory: Path) -> None:
    from datapipe.tools.synthetic import render_image

    for c, name in enumerate(("cat", "dog")):
        (directory / name).mkdir(parents=True)
        for i in range(6):
            jpg, _ = render_image(c * 6 + i, seed=1, num_classes=2, size=(96, 72))
            (directory / name / f"{name}{i}.jpg").write_bytes(jpg)


@pytest.fixture(scope="session")
def doc_data(tmp_path_factory) -> Path:
    from datapipe.tools.synthetic import make_image_dataset

    root = tmp_path_factory.mktemp("doc-data")
    make_image_dataset(str(root / "shards"), num_images=64, num_classes=10, shard_max_count=16, size=(96, 72),
                       progress=False)
    make_image_dataset(str(root / "more-shards"), num_images=32, num_classes=10, shard_max_count=16, size=(96, 72),
                       seed=1, progress=False)
    _write_npy_docs(root / "tokens")
    _write_photos(root / "photos")
    with open(root / "text.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i + 1)}) + "\n")
    return root


# --- running the blocks -------------------------------------------------------------------------

@dataclass
class PageRun:
    directory: Path
    namespace: dict
    ran: set


_RUNS: dict[Path, PageRun] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_runs():
    yield
    _RUNS.clear()  # drop the pages' loaders (and their workers) before the next module
    gc.collect()


def _page_run(page: Path, doc_data: Path, tmp_path_factory) -> PageRun:
    run = _RUNS.get(page)
    if run is None:
        directory = tmp_path_factory.mktemp("doc-" + page.stem)
        shutil.copytree(doc_data, directory, dirs_exist_ok=True)
        run = _RUNS[page] = PageRun(directory, {"__name__": "__doctest__"}, set())
    return run


def _execute(block: Block, run: PageRun) -> bool:
    """Run ``block`` in its page's namespace; True once it ran to its end (an exception propagates)."""
    run.ran.add(block.index)
    exec(compile(block.source, block.id, "exec"), run.namespace)
    return True


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block(block: Block, doc_data, tmp_path_factory, monkeypatch):
    if block.skip is not None:
        pytest.skip(f"{block.id} marked: {block.skip}")
    run = _page_run(block.page, doc_data, tmp_path_factory)
    monkeypatch.chdir(run.directory)
    for earlier in BLOCKS:  # a failed one has run (and failed in its own test): this block goes on without it
        if earlier.page == block.page and earlier.index < block.index and earlier.skip is None \
                and earlier.index not in run.ran:
            _execute(earlier, run)
    if block.index in run.ran:  # run again only when asked alone after its page ran (e.g. -k)
        return
    assert _execute(block, run), f"{block.id} did not run to its end"


def test_skip_markers():
    """Every marker sits right before a Python block and names a GPU or remote-store need."""
    problems = []
    for page in PAGES:
        blocks, stray = parse(page)
        problems += [f"{page.relative_to(ROOT)}:{line}: {text.strip()} precedes no Python block (or is malformed)"
                     for line, text in stray]
        problems += [f"{b.id}: skip reason {b.skip!r} names no GPU or remote-store need"
                     for b in blocks if b.skip is not None and not SKIP_REASONS.search(b.skip)]
    assert not problems, "\n".join(problems)


def test_pages_have_examples():
    """The README's usage examples are found and run (a parser bug must not turn into no test)."""
    readme = [b for b in BLOCKS if b.page.name == "README.md"]
    assert len([b for b in readme if b.skip is None]) >= 4, [b.id for b in readme]


def test_index_names_every_command():
    """docs/index.md, the map of the docs, names every `datapipe` command (doctor and bench were missing)."""
    from datapipe.cli import COMMANDS

    index = (ROOT / "docs" / "index.md").read_text()
    assert not [c for c in COMMANDS if f"`datapipe {c}" not in index]


def test_option_tables_state_the_code_defaults():
    """docs/loaders.md's option-group tables give each default as the code has it (`image_exts` read jpg, jpeg,
    png where the code reads every type `datapipe shard` writes, #44)."""
    import dataclasses

    import loaders

    rows = re.findall(r"^\| `\w+=loaders\.(\w+)\(\.\.\.\)` \| (.*) \|$", (ROOT / "docs" / "loaders.md").read_text(), re.M)
    assert {"ReadOptions", "DecodeOptions", "AugmentOptions"} <= {name for name, _ in rows}
    wrong = []
    for name, cell in rows:
        fields = {f.name: f for f in dataclasses.fields(getattr(loaders, name))}
        for key, value in re.findall(r"`(\w+)=([^`]*)`", cell):
            f = fields[key]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if eval(value, {"__builtins__": {}}) != default:  # literals and fractions such as 3/4
                wrong.append(f"{name}({key}={value}): the code's default is {default!r}")
    assert not wrong, wrong


def test_readme_names_every_on_error_mode_where_it_introduces_on_error():
    """The README's first on_error names every mode (it never said "warn", the one that logs each skip, #44)."""
    from datapipe.errors import HANDLERS

    readme = (ROOT / "README.md").read_text()
    start = readme.index("on_error=")
    introduced = readme[start:readme.index("\n\n", start)]
    assert not [mode for mode in HANDLERS if f'"{mode}"' not in introduced], introduced


def _bad_three(sample):
    if sample["__key__"] in ("s0-00001", "s0-00004", "s1-00002"):
        raise ValueError("a bad sample")
    return int(sample["cls"])


def test_readme_says_which_stats_count_the_skips(tmp_path):
    """The README's on_error comment said "skip" counts each skip "in stats()", but `stream.stats()` showed
    none while the derived stream it iterates and the loader showed all 3 (#44): the objects it names are those
    that count them."""
    import datapipe
    import loaders
    from tests.shards import write_shards

    readme = (ROOT / "README.md").read_text()
    start = readme.index('"skip" counts', readme.index("on_error="))
    comment = readme[start:readme.index('"warn"', start)]
    named = set(re.findall(r"\b(stream|train|loader)\b", comment))
    urls, _ = write_shards(tmp_path / "s", [6, 6])
    stream = datapipe.ShardStream(urls, shuffle=True, seed=0, on_error="skip")
    train = stream.decode("pil").map(_bad_three)
    loader = loaders.DataLoader(train, batch_size=4, num_workers=2)
    assert sum(len(y) for y in loader) == 9
    counting = {name for name, x in (("stream", stream), ("train", train), ("loader", loader))
                if x.stats()["skipped"] == 3}
    assert counting == {"train", "loader"} and named == counting, (named, comment)


def test_loaders_page_says_which_bad_images_decode_errors_counts(tmp_path):
    """docs/loaders.md said an image dropped under "skip" is counted in both `skipped` and `decode_errors`, but the
    3 truncated images the stream reader's check catches before DALI gave skipped=3, decode_errors=0 (#44)."""
    pytest.importorskip("nvidia.dali")
    import webdataset

    import datapipe
    from datapipe.tools.synthetic import iter_image_samples
    from loaders.images.loader import ImageLoader
    from loaders.images.options import ReadOptions

    samples = list(iter_image_samples(8, seed=1, num_classes=4, size=(48, 40)))
    for s in samples[1:4]:
        s["jpg"] = s["jpg"][: len(s["jpg"]) // 2]  # no end-of-image marker
    with webdataset.TarWriter(str(tmp_path / "shard-000000.tar")) as w:
        for s in samples:
            w.write(s)
    stream = datapipe.ShardStream([str(tmp_path / "shard-000000.tar")], on_error="skip")
    dl = ImageLoader(stream, batch_size=4, image_size=16, train=False, device="cpu",
                     read=ReadOptions(reader="stream", drop_last=False))
    assert sum(len(y) for _, y in dl) == 5
    stats = dl.stats()
    page = (ROOT / "docs" / "loaders.md").read_text()
    errors = " ".join(next(p for p in page.split("\n\n") if p.startswith("**Errors.**")).split())
    assert stats["skipped"] == 3 and stats["decode_errors"] == 0, stats
    assert "counts in `skipped` only" in errors and "before DALI" in errors, errors


def test_readme_names_every_type_a_loader_state_holds(tmp_path):
    """The README's checkpoint sentence names what a DataLoader's state holds (it said "plain values" beside
    torch's RNG state, a tensor)."""
    import numpy as np
    import torch

    import datapipe
    import loaders
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "s", [6, 6])
    loader = loaders.DataLoader(datapipe.ShardStream(urls, shuffle=True).map(lambda s: int(s["cls"])), batch_size=2)
    it = iter(loader)
    next(it)

    def leaves(x):
        if isinstance(x, dict):
            return [t for v in x.values() for t in leaves(v)]
        return [t for v in x for t in leaves(v)] if isinstance(x, (list, tuple)) else [type(x)]

    words = {int: "ints", str: "strings", np.ndarray: "numpy arrays", torch.Tensor: "tensor"}
    sentence = next(p for p in (ROOT / "README.md").read_text().split("\n\n") if p.startswith("Checkpoint and resume"))
    held = {t for t in leaves(loader.state_dict()) if t not in (bool, type(None), float)}
    assert held and not [t for t in held if words.get(t, "?") not in " ".join(sentence.split())], held


def test_parser(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\na = 1\n```\n\n<!-- doctest: skip (needs CUDA) -->\n\n```python\nb = 2\n```\n"
        "- item\n\n  ```py\n  c = a\n  ```\n\n```bash\nls\n```\n<!-- doctest: skip (slow) -->\n```text\nx\n```\n"
        "<!-- doctest: skip(needs a GPU) -->\nparagraph\n```python\nd = 4\n```\n<!-- doctest: run -->\n"
    )
    blocks, stray = parse(page)
    assert [(b.source, b.skip) for b in blocks] == [("a = 1\n", None), ("b = 2\n", "needs CUDA"),
                                                    ("c = a\n", None), ("d = 4\n", None)]
    assert [line for line, _ in stray] == [21, 25, 30]
