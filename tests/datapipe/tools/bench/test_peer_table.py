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
