"""datapipe.tools.bench.peer_continue: which rows an earlier peers run finished, and whether it matches."""
import pytest

from datapipe.tools.bench import peer_continue as pc

SETTINGS = {k: 1 for k in pc.SAME_SETTINGS}


def test_a_row_its_budget_cut_is_not_finished_but_its_own_failure_is():
    assert pc.finished({"samples": 3}) and pc.finished({"error": "no mid-epoch resume"})
    assert not pc.finished({"error": "not run: the run's budget of 5 s was spent"})
    assert not pc.finished({"error": "stopped at the run's budget of 5 s"})
    assert not pc.finished(None)


def test_a_system_is_finished_when_every_row_is():
    done = {"write": {}, "resume": {"error": "no mid-epoch resume"}, "decode": {}, "raw": {"0": {}, "4": {}}}
    assert pc.all_finished(done, (0, 4))
    assert not pc.all_finished(done, (0, 4, 8))  # the 8-worker row never ran
    assert not pc.all_finished({**done, "decode": {"error": "not run: the run's budget of 1 s was spent"}}, (0, 4))
    # a system with a decoder of its own is finished only once that row ran too, and the row is handed on
    assert not pc.all_finished(done, (0, 4), own_decoder=True)
    assert pc.all_finished({**done, "decode_own": {"error": "DALI is not installed"}}, (0, 4), own_decoder=True)
    assert "decode_own" in pc.ROWS_KEPT and "raw" in pc.ROWS_KEPT


def test_an_earlier_run_of_other_settings_is_refused():
    earlier = {"settings": dict(SETTINGS), "source": {"images": 10}, "systems": {"torch": {}}}
    assert pc.earlier_systems(earlier, SETTINGS, 10) == {"torch": {}}
    assert pc.earlier_systems(None, SETTINGS, 10) == {}
    with pytest.raises(ValueError, match="batch_size 1 -> 2"):
        pc.earlier_systems(earlier, {**SETTINGS, "batch_size": 2}, 10)
    with pytest.raises(ValueError, match="another image count"):
        pc.earlier_systems(earlier, SETTINGS, 11)
