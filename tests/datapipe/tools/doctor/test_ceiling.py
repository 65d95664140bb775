"""The doctor's data-free ceiling (datapipe/tools/doctor/ceiling.py) and how the report says it."""
import time

import pytest

from datapipe.tools.doctor.ceiling import ceiling_meaning
from datapipe.tools.doctor.report import Doctor
from datapipe.tools.doctor.report_text import format_report
from tests.datapipe.tools.doctor.test_report import sleepy


def test_ceiling_replays_one_cached_batch_through_the_step():
    """ceiling_steps: after `ceiling_after` batches the last one is replayed; nothing of the loader is lost."""
    seen = []
    with Doctor(print_report=False, ceiling_steps=6, ceiling_after=3) as d:
        for batch in d.wrap(sleepy(10, 0.0)):
            seen.append(batch)
    rep = d.finish()
    assert len(seen) == 10 + 6
    assert all(b is seen[2] for b in seen[3:9])  # the third batch, replayed 6 times
    assert [int(b[0]) for b in seen[:3] + seen[9:]] == list(range(10))  # every loader batch, in order
    assert rep["steps"] == 10  # the replay is not counted as the loader's steps
    assert rep["ceiling_steps"] == 6 and rep["ceiling_batches_per_s"] > 0
    # the report says what the replay did to the run: 6 extra steps on a repeated batch
    assert rep["ceiling_replayed_batches"] == 6
    assert rep["ceiling_replay"].startswith("batch 3 was handed to the training loop 6 more times: 6 extra training "
                                            "steps (optimizer steps")
    text = format_report(rep)
    assert "note: the ceiling replay changed your run: batch 3 was handed to the training loop 6 more times" in text


def test_ceiling_ratio_of_a_slow_and_a_fast_loader():
    """A 10 ms step fed by a loader sleeping 30 ms per batch runs at ~1/3 of its data-free rate."""
    def run(fetch_s):
        with Doctor(print_report=False, ceiling_steps=5, ceiling_after=2) as d:
            for _ in d.wrap(sleepy(12, fetch_s)):
                time.sleep(0.01)
        return d.finish()

    slow, fast = run(0.03), run(0.0)
    assert slow["ceiling_ratio"] < 0.6 < fast["ceiling_ratio"]
    text = format_report(slow)
    assert "loaded / data-free step rate" in text and "slower than the same step fed one cached batch" in text
    assert "ceiling ratio" not in text


def test_a_ratio_above_one_is_not_reported_as_a_speed_up():
    assert "not a speed-up" in ceiling_meaning(1.088)
    assert "no cost of the loader is measurable" in ceiling_meaning(1.0)
    assert ceiling_meaning(0.95) == "the loaded steps ran 5.0% slower than the same step fed one cached batch"


def test_ceiling_not_measured_is_said_and_bad_arguments_raise():
    with Doctor(print_report=False, ceiling_steps=5, ceiling_after=4) as d:
        for _ in d.wrap(sleepy(3, 0.0)):
            pass
    rep = d.finish()
    assert rep["ceiling_ratio"] is None and "not measured" in rep["ceiling"]
    assert rep["ceiling_replayed_batches"] == 0 and "0 more times" in rep["ceiling_replay"]
    assert Doctor(print_report=False).report()["ceiling"].startswith("not requested")
    with pytest.raises(ValueError, match="ceiling_steps"):
        Doctor(ceiling_steps=-1)
    with pytest.raises(ValueError, match="ceiling_after"):
        Doctor(ceiling_after=0)
