"""bench/: the scripts that reproduce the README's table, each explaining itself with --help."""
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
HELPERS = ("__init__.py", "common.py", "models.py", "ceiling_record.py", "ceiling_feeds.py",
           "nvimg_feed.py")  # modules the scripts import
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)


def test_bench_keeps_a_handful_of_scripts():
    assert 5 <= len(SCRIPTS) <= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_the_script(script):
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=BENCH.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    first_line = (BENCH / script).read_text().split('"""')[1].strip().splitlines()[0]
    assert "usage:" in out.stdout and first_line[:40] in " ".join(out.stdout.split())


def test_results_hold_one_current_file_per_benchmark():
    names = sorted(p.stem for p in (BENCH / "results").glob("*.json"))
    assert len(names) == len(set(names))
    assert not [n for n in names if n.endswith(("_b", "_c", "_d", "_old", "_final"))], names
    assert not (BENCH / "HISTORY.md").exists()


def test_results_name_only_scripts_that_exist():
    """A result's text (its note, its command) names the bench script that made it: one that is still here."""
    import json
    import re

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    gone = {f"{p.name}: {name}" for p in (BENCH / "results").glob("*.json")
            for text in strings(json.loads(p.read_text())) for name in re.findall(r"\bbench/(\w+\.py)\b", text)
            if not (BENCH / name).exists()}
    assert not gone, sorted(gone)
