"""A JPEG with a right signature and end marker around a garbage header, at batch 64 on DALI's CPU pipeline.

DALI's CPU decoder crashes the whole process on such a file (a segfault), so each case runs in a child
process, bounded in time: a crash fails the test instead of ending pytest.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import webdataset

pytest.importorskip("nvidia.dali")

from datapipe.tools.synthetic import iter_image_samples  # noqa: E402

N, BAD = 128, ("k005", "k070")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("damaged") / "shard-000000.tar"
    rng = np.random.default_rng(3)
    with webdataset.TarWriter(str(path)) as w:
        for i, s in enumerate(iter_image_samples(N, num_classes=4, size=(40, 30))):
            key = f"k{i:03d}"
            data = s["jpg"]
            if key in BAD:
                data = b"\xff\xd8\xff\xe0" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes() + b"\xff\xd9"
            w.write({"__key__": key, "jpg": data, "cls": str(i % 4).encode()})
    return str(path)


CHILD = textwrap.dedent("""
    import sys
    from datapipe import DataError, ShardStream
    from loaders.images.loader import ImageLoader
    from loaders.images.options import ReadOptions
    url, on_error = sys.argv[1], sys.argv[2]
    lo = ImageLoader(ShardStream(url, on_error=on_error), batch_size=64, image_size=32, device="cpu", train=False,
                     read=ReadOptions(reader="stream"))
    try:
        print("images", sum(len(y) for _, y in lo), "skipped", lo.stats()["skipped"], flush=True)
    except DataError as e:
        print("DataError", e, flush=True)
""")


def _child(shard, on_error):
    done = subprocess.run([sys.executable, "-c", CHILD, shard, on_error], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"the child ended with {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_a_damaged_jpeg_header_is_a_counted_skip_not_a_crash(shard, on_error):
    assert f"images {N - len(BAD)} skipped {len(BAD)}" in _child(shard, on_error)


def test_a_damaged_jpeg_header_raises_naming_shard_and_key(shard):
    out = _child(shard, "raise")
    assert out.startswith("DataError") and "damaged JPEG header" in out and shard in out and BAD[0] in out
