"""Grain's and Energon's worker rows in the peers harness (issue #43 item 5): Grain's absl flags where nothing
parsed them, Energon's second epoch after a first one cut at the epoch cap."""
import pytest

from datapipe.tools.bench import peers

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
