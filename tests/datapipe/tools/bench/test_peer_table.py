"""datapipe.tools.bench.peer_table: the peers' figures as a table and the notes under it."""
from datapipe.tools.bench.peer_table import run_notes, table_rows


def test_notes_say_why_a_system_was_not_measured():
    result = {"notes": ["worker counts [8] exceed the 2 usable cores here: those rows share cores"],
              "systems": {"datapipe": {"version": "x"}, "mosaicml": {"version": None, "error": "not installed (...)"}}}
    assert run_notes(result) == ["note: worker counts [8] exceed the 2 usable cores here: those rows share cores",
                                       "mosaicml: not measured: not installed (...)"]


def test_table_cells_say_what_is_missing_and_why():
    result = {"table": [{"row": "resume, exact rest", "datapipe": True, "torch": None, "mosaicml": None},
                        {"row": "write, images/s", "datapipe": 6368.6, "torch": 0.5, "mosaicml": None}],
              "systems": {"datapipe": {}, "torch": {}, "mosaicml": {"error": "not installed"}}}
    assert table_rows(result) == [{"row": "resume, exact rest", "datapipe": "yes", "torch": "-", "mosaicml": "n/a"},
                                  {"row": "write, images/s", "datapipe": "6,369", "torch": "0.50", "mosaicml": "n/a"}]


def test_notes_name_failed_rows_and_cut_epochs():
    result = {"settings": {"epoch_cap_s": 5.0},
              "systems": {"grain": {"write": {"images": 3}, "resume": {"error": "no mid-epoch resume"},
                                    "raw": {"0": {"epoch1": {"samples": 9, "capped": True}, "epoch2": {"samples": 9}},
                                            "4": {"error": "timed out after 60 s"}},
                                    "decode": {"error": "not run: the run's budget of 440 s was spent"}}}}
    assert run_notes(result) == ["grain: decode: not run: the run's budget of 440 s was spent",
                                 "grain: raw bytes, 4 workers: timed out after 60 s",
                                 "grain: cut at 5.0 s (rate over what was read): 0 workers epoch 1"]


def test_how_lines_say_what_each_system_did():
    from datapipe.tools.bench.peer_table import how_lines

    result = {"systems": {"spdl": {"how": {"format": "loose files", "0 workers": "1 thread"}},
                          "mosaicml": {"version": None, "error": "not installed"}}}
    assert how_lines(result) == ["spdl: format: loose files; 0 workers: 1 thread"]


def test_summary_has_the_run_of_record_rows():
    from datapipe.tools.bench.peer_table import summary

    result = {"settings": {"workers": [0, 4], "decode_workers": 14, "resume_workers": 4},
              "systems": {"energon": {"raw": {"0": {"construct_first_batch_s": 0.9}},
                                      "resume": {"first_batch_s": 2.0, "exact": None, "same_order": True}}}}
    rows = {r["row"]: r["energon"] for r in summary(result)}
    assert rows["construct + first batch, 0 workers (s)"] == 0.9
    assert rows["mid-epoch resume, 4 workers, first batch after load (s)"] == 2.0
    assert rows["mid-epoch resume, same continuation"] is True and rows["mid-epoch resume, exact rest"] is None
    assert "PIL decode + crop, 14 workers, steady samples/s" in rows


def test_decode_rows_timed_under_the_window_asked_are_named():
    from datapipe.tools.bench.peer_table import short_decodes

    result = {"settings": {"decode_seconds": 3.0},
              "systems": {"torch": {"decode": {"steady_seconds": 3.01}},
                          "datapipe": {"decode": {"steady_seconds": 0.66}, "decode_own": {"steady_seconds": 0.001}},
                          "grain": {"decode": {"error": "stopped at the run's budget"}}}}
    assert short_decodes(result) == ["datapipe decode (0.66 s)", "datapipe decode_own (0.001 s)"]
    assert short_decodes({**result, "settings": {"decode_seconds": None}}) == []
