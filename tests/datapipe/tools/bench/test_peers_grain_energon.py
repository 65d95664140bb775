"""Grain's and Energon's worker rows in the peers harness (issue #43 item 5): Grain's absl flags where nothing
parsed them, Energon's second epoch after a first one cut at the epoch cap."""
import pytest

from datapipe.tools.bench import peers
from datapipe.tools.bench.peer_readers import _pickle_tuple

grain = pytest.importorskip("grain")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return peers.make_image_folder(str(tmp_path_factory.mktemp("peers-ge") / "images"), num_images=24,
                                   num_classes=3, size=(48, 36), workers=1)


@pytest.fixture
def unparsed_flags():
    """absl's flags as in a program not started by ``absl.app.run`` (restored after)."""
    from absl import flags

    was = flags.FLAGS.is_parsed()
    flags.FLAGS.unparse_flags()
    yield flags.FLAGS
    flags.FLAGS.unparse_flags()
    if was:
        flags.FLAGS.mark_as_parsed()


def _worker_sees_parsed_flags(record):  # runs in Grain's spawned worker (pickled by value: a test module)
    from absl import flags

    return "k", b"x", int(flags.FLAGS.is_parsed())


@pytest.mark.slow
def test_grain_workers_run_where_its_profiler_reads_an_unparsed_flag(source, tmp_path, unparsed_flags,
                                                                     monkeypatch):
    import cloudpickle
    from grain._src.core import profiler

    from datapipe.tools.bench.peer_readers import GrainLoader
    from datapipe.tools.bench.peer_writers import write

    write("grain", source, str(tmp_path / "grain"), workers=1)
    # what JAX (jaxlib with subprocess hooks) being installed makes Grain do: read
    # --grain_enable_multiprocess_worker_profiling when mp_prefetch starts its workers (the H200 run's failure)
    monkeypatch.setattr(profiler, "_framework", "jax")
    monkeypatch.setattr(profiler, "_subprocess_hooks_loaded", True)
    import sys

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        loader = GrainLoader(str(tmp_path / "grain"), batch_size=6, workers=2, seed=0, fn=_worker_sees_parsed_flags)
        labels = [label for _, _, batch_labels in loader for label in batch_labels]
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert len(labels) == 24
    assert set(labels) == {1}, "Grain's worker processes see absl's flags unparsed"


@pytest.mark.slow
def test_energon_workers_read_epoch_2_after_an_epoch_cut_at_the_cap(source, tmp_path):
    pytest.importorskip("megatron.energon")
    from datapipe.tools.bench.peer_writers import write

    data = str(tmp_path / "energon")
    write("energon", source, data, workers=1)
    row = peers.row_raw("energon", data, batch_size=4, workers=2, seed=0, cache_dir=None, cap_s=1e-9)
    assert row["epoch1"]["capped"] is True and row["epoch1"]["samples"] == 4
    assert row["epoch2"]["samples"] == 4 and row["epoch2"]["samples_per_s"] > 0, row
    # Energon's savable loader goes on with a pass cut short at the next iter(): its rest is read (and said),
    # then epoch 2 is a pass of its own
    assert row["epoch1"]["samples"] + row["epoch1_rest"]["samples"] == 24, row


def _big_value(record):  # 1 MB a value: a pickled batch of these overfills a worker's pipe
    key, _, label = _pickle_tuple(record)
    return key, key.encode() * (1_000_000 // len(key)), label


@pytest.mark.slow
def test_grain_workers_hand_over_raw_batches_whole_and_close_a_cut_pass_at_once(source, tmp_path):
    """With workers, raw batches travel as one NumPy array (Grain's shared memory), read back value by value; a
    pickled list of 1 MB values stuck in a stopped worker's pipe made every close wait for Grain's 25 s kill."""
    import time

    from datapipe.tools.bench.peer_readers import GrainLoader, list_images, read_item
    from datapipe.tools.bench.peer_writers import write

    write("grain", source, str(tmp_path / "grain"), workers=1)
    images = {item[1]: read_item(item) for item in list_images(source)}
    loader = GrainLoader(str(tmp_path / "grain"), batch_size=5, workers=2, seed=0, fn=_pickle_tuple, pack=True)
    seen = {}
    for keys, values, labels in loader:
        for k, v, label in zip(keys, values, labels):
            seen[k] = (bytes(v), label)
    assert seen == {k: (s["image"], s["cls"]) for k, s in images.items()}

    big = GrainLoader(str(tmp_path / "grain"), batch_size=1, workers=2, seed=0, fn=_big_value, pack=True)
    for _ in range(3):
        it = iter(big)
        keys, values, _ = next(it)
        assert [bytes(v) for v in values] == [k.encode() * (1_000_000 // len(k)) for k in keys]
        time.sleep(0.5)  # the workers fill their pipes with the next batches
        t0 = time.perf_counter()
        it.close()
        assert time.perf_counter() - t0 < 10, "a worker blocked on exit until Grain killed it"
