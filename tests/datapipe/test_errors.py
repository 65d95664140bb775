import logging
import pickle

import pytest

from datapipe.errors import LAST_ERRORS, DataError, ErrorPolicy, check_on_error, reraise, with_hint


def test_named_handlers_count_in_one_place(caplog):
    skip = ErrorPolicy("skip")
    for i in range(LAST_ERRORS + 3):
        skip(DataError(f"bad {i}"), lost=2)
    assert skip.stats() == {"errors": LAST_ERRORS + 3, "skipped": 2 * (LAST_ERRORS + 3),
                            "last_errors": [f"bad {i}" for i in range(3, LAST_ERRORS + 3)]}
    raising = ErrorPolicy("raise")
    assert raising.raises and not skip.raises
    with pytest.raises(DataError, match="stop"):
        raising(DataError("stop"))
    assert raising.stats()["errors"] == 0 and raising.stopped is not None
    with caplog.at_level(logging.WARNING):
        ErrorPolicy("warn", log=logging.getLogger("datapipe.somewhere"))(DataError("odd"))
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("datapipe.somewhere", "skipped: odd")]


def test_callable_handler_and_bad_names():
    seen = []
    policy = ErrorPolicy(seen.append)
    policy(DataError("x"), lost=0)
    policy.note(DataError("y"), lost=1)  # already handled: counted, the handler is not asked
    assert [str(e) for e in seen] == ["x"] and policy.stats()["errors"] == 2 and policy.stats()["skipped"] == 1
    assert not policy.raises
    with pytest.raises(ValueError, match="on_error"):
        check_on_error("ignore")
    with pytest.raises(ValueError, match="on_error"):
        ErrorPolicy("ignore")


def test_policy_pickles_for_worker_processes():
    policy = ErrorPolicy("warn", log=logging.getLogger("datapipe.stream"))
    with pytest.raises(DataError):
        ErrorPolicy("raise")(DataError("z"))
    policy.stopped = DataError("z")
    copy = pickle.loads(pickle.dumps(policy))
    copy(DataError("w"))
    assert copy.stats()["last_errors"] == ["w"] and copy.stopped is None


def test_a_bad_samples_error_under_raise_says_how_to_skip_such_samples():
    """Issue #44: the default on_error="raise" named shard and key but not what to do; each hint once."""
    policy = ErrorPolicy("raise")
    for call in (policy, policy.handler):  # the stream's policy, and loaders calling its handler directly
        with pytest.raises(DataError) as e:
            call(DataError("cannot decode image 'jpg'", url="s/shard-000000.tar", key="000002"))
        text = str(e.value)
        assert text.startswith("cannot decode image 'jpg' (shard s/shard-000000.tar, key '000002'); ")
        assert 'on_error="skip"' in text and '"warn"' in text and "datapipe shard --check-images" in text
        with pytest.raises(DataError) as again:
            policy.handler(e.value)  # raised on through a second policy: no second hint
        assert str(again.value).count("on_error=") == 1
        assert pickle.loads(pickle.dumps(again.value)).args == again.value.args
    with pytest.raises(DataError) as e:
        policy(DataError("map(f) failed: KeyError: 'x'", url="s/shard-000000.tar", key="000003"))
    assert 'on_error="skip"' in str(e.value) and "--check-images" not in str(e.value)  # not an image
    with pytest.raises(DataError) as e:
        policy(DataError("cannot open", url="s/shard-000009.tar"))  # no sample: storage, not a bad sample
    assert str(e.value) == "cannot open (shard s/shard-000009.tar)"


def test_a_data_error_survives_pickling_with_every_attribute():
    err = with_hint(DataError("cannot decode image 'jpg'", url="s/shard-000000.tar", key="000002", what="shard"))
    again = pickle.loads(pickle.dumps(err))
    assert (again.url, again.key, again.what, str(again)) == (err.url, err.key, "shard", str(err))
    assert again.hinted and str(with_hint(again)) == str(err)  # the hint once, not again after the trip
    folder = pickle.loads(pickle.dumps(DataError("no such folder", url="nope/", what="folder")))
    assert (folder.url, folder.key, folder.what) == ("nope/", None, "folder")


@pytest.mark.parametrize("made", [
    dict(url="s/shard-000000.tar", key="000002"),
    dict(url="http://h/a (b)/shard-1.tar", key="it's, key 'x' (2)"),
    dict(url="s/shard-000001.tar"),
    dict(key="k (1)"),
    dict(url="out/manifest.json", what="manifest"),
    dict(),
])
def test_torch_rebuilding_a_worker_data_error_from_its_text_keeps_url_and_key(made):
    """Issue #44: torch re-raises a DataLoader worker's exception as ``type(e)(its formatted traceback)``
    (``ExceptionWrapper``): url and key were None in the main process, though the message named them."""
    from torch._utils import ExceptionWrapper

    try:
        reraise(DataError("cannot decode image (bad header) 'jpg'", **made))
    except DataError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError, match="^Caught DataError in DataLoader worker process 0") as info:
        wrapper.reraise()
    err = info.value
    assert (err.url, err.key, err.what) == (made.get("url"), made.get("key"), made.get("what", "shard"))
    assert str(with_hint(err)) == str(err), "the hint was given in the worker: not twice"
