"""scripts/setup-venv.sh (the demo's and the tests' install): a line per step, and no import checks on a rerun when
setup.cfg, constraints.txt and the script are unchanged. Run against a fake .venv whose python logs its calls."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
case "$*" in
  *hashlib*) exec "{real}" "$@";;
  "-m pip"*) [ -z "${{PIP_FAILS:-}}" ];;
  *"import torch, webdataset"*) [ -z "${{MISSING:-}}" ];;
  *) true;;
esac
"""


@pytest.fixture
def repo(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup-venv.sh", tmp_path / "scripts")
    for name in ("setup.cfg", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON.format(real=sys.executable))
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return tmp_path


def setup(repo, **env):
    """Source the script as scripts/demo.sh does; (exit code, stderr, the fake python's calls)."""
    log = repo / "calls.log"
    log.write_text("")
    run = subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/setup-venv.sh"], cwd=repo,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LOG": str(log), **env}, stdin=subprocess.DEVNULL)
    return run.returncode, run.stderr, log.read_text().splitlines()


def checks(calls):
    return [c for c in calls if c.startswith("-c import") and "hashlib" not in c]


def test_a_rerun_with_nothing_changed_skips_the_import_checks(repo):
    code, err, calls = setup(repo)
    assert code == 0 and "checking the installed packages" in err and "ready" in err
    assert checks(calls) and not [c for c in calls if "pip install" in c]
    code, err, calls = setup(repo)
    assert code == 0 and "import checks skipped" in err and not checks(calls)
    with open(repo / "constraints.txt", "a") as f:
        f.write("# a new pin\n")
    code, err, calls = setup(repo)
    assert code == 0 and "checking the installed packages" in err and checks(calls)
    assert len(list((repo / ".venv").glob(".setup-ok-*"))) == 1  # the old stamp is gone


def test_an_install_prints_a_line_per_step_and_a_failed_one_leaves_no_stamp(repo):
    code, err, calls = setup(repo, MISSING="1", PIP_FAILS="1")
    assert code != 0 and "installing 1/3" in err and "the install failed" in err
    assert not list((repo / ".venv").glob(".setup-ok-*"))
    code, err, calls = setup(repo, MISSING="1")
    assert code == 0
    for step in ("installing 1/3: pip", "installing 2/3: torch", "installing 3/3: datapipe", "ready"):
        assert step in err
    assert [c for c in calls if "pip install" in c and "-e .[test,dali,s3,ray,synthetic]" in c]
    assert list((repo / ".venv").glob(".setup-ok-*"))
