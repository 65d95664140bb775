"""bench/ceiling.py's row names: which variant a row runs and which settings its suffixes change."""
import pytest

from bench.ceiling import dali_pipeline_row, row_base, row_options, row_pace, row_ready, row_suffixes, variant_of


def test_suffixes_combine_and_strip_to_the_variant():
    assert row_suffixes("imageloader_legacy_syncexec_pace08") == ["_pace08", "_syncexec", "_legacy"]
    assert row_base("imageloader2_legacy_syncexec_pace08") == "imageloader2"
    assert variant_of("imageloader2_syncexec", {"imageloader": None}) == "imageloader"
    assert variant_of("il_nothing_syncexec", {"imageloader": None}) is None


def test_pace_suffixes_are_told_apart():
    assert row_pace("imageloader_pace08") == 0.8
    assert row_pace("imageloader_pace085") == 0.85
    assert row_pace("imageloader_unpaced") == 0.0
    assert row_pace("imageloader_syncexec") is None  # the library's default


def test_ready_suffixes_set_the_handoff_and_strip_to_the_variant():
    assert row_ready("imageloader2_hostready") == "host"
    assert row_ready("il_hw0_eventready_pace08") == "event"
    assert row_ready("imageloader3_checkedready") == "checked"
    assert row_ready("imageloader") is None
    assert variant_of("imageloader2_hostready", {"imageloader": None}) == "imageloader"
    assert row_options("imageloader2_checkedready_unpaced") == {"pace": None, "ready": "checked"}
    assert row_options("tokens_pace07") == {"pace": 0.7} and row_options("imageloader2") == {}


def test_a_rows_suffixes_reach_its_loaders_options(monkeypatch):
    import types

    import loaders
    from bench import ceiling

    made = []
    monkeypatch.setattr(loaders, "ImageLoader", lambda urls, **kw: made.append(kw))
    args = types.SimpleNamespace(batch_size=2, image_size=16, device="cpu")
    monkeypatch.setattr(ceiling, "ROW_OPTIONS", {"pace": None, "ready": "host"})  # as loaded() sets a row's
    ceiling.image_loader(["a.tar"], args, hw_decoder_load=0.0)
    assert made[-1] == dict(batch_size=2, image_size=16, device="cpu", pace=None, ready="host", hw_decoder_load=0.0)
    assert ceiling.row_option("pace") == {"pace": None}
    monkeypatch.setattr(ceiling, "ROW_OPTIONS", {})  # a row without such suffixes: the library's defaults
    ceiling.image_loader(["a.tar"], args)
    assert made[-1] == dict(batch_size=2, image_size=16, device="cpu") and ceiling.row_option("pace") == {}


def _built(name: str):
    from loaders.images.dali_pipeline import build_image_pipeline

    with dali_pipeline_row(name):
        return build_image_pipeline(batch_size=2, image_size=16, train=True, device="cpu", device_id=None,
                                    num_threads=1)


def test_syncexec_rows_build_a_synchronous_pipeline_and_others_keep_the_builders():
    pytest.importorskip("nvidia.dali")
    default = _built("imageloader")
    assert default.exec_async and default.exec_pipelined
    sync = _built("imageloader2_syncexec")
    assert not sync.exec_async and not sync.exec_pipelined
    legacy_sync = _built("imageloader_legacy_syncexec")
    assert not legacy_sync.exec_async and legacy_sync.exec_dynamic is False
    assert _built("imageloader").exec_async  # the patch is gone after the row


def test_nommap_rows_read_shards_with_plain_file_io(monkeypatch):
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn.readers as dali_readers
    from nvidia.dali import fn

    assert fn.readers is dali_readers  # the pipeline builder's fn.readers.webdataset is the patched one
    calls = []
    monkeypatch.setattr(dali_readers, "webdataset", lambda *a, **kw: calls.append(kw))
    with dali_pipeline_row("imageloader2_nommap"):
        fn.readers.webdataset(paths=["a.tar"])
    with dali_pipeline_row("imageloader"):
        fn.readers.webdataset(paths=["b.tar"])
    assert calls == [{"paths": ["a.tar"], "dont_use_mmap": True}, {"paths": ["b.tar"]}]
