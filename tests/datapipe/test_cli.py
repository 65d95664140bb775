import subprocess
import sys

import pytest

from datapipe.cli import COMMANDS, main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_help_and_unknown_commands():
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2


def test_top_level_help_names_every_input_of_the_shard_job(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "CSV/JSONL image lists" in out and "JSONL/Parquet text" in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: datapipe " + command in capsys.readouterr().out


def test_python_dash_m_entry_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "datapipe", "inspect", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "missing" in out.stderr


def test_verbose_turns_on_debug_for_datapipe_only(tmp_path):
    code = ("import logging\nfrom datapipe.cli import main\n"
            f"main(['-v', 'inspect', {str(tmp_path / 'missing')!r}])\n"
            "names = ('datapipe', 'datapipe.jobs.shard.job', 'loaders', 'packing', 'fsspec', 'urllib3', 'aiohttp')\n"
            "print(' '.join(str(logging.getLogger(n).getEffectiveLevel()) for n in names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    levels = [int(x) for x in out.stdout.split()]
    assert levels[:4] == [10, 10, 10, 10], out  # DEBUG for datapipe's loggers
    assert all(level >= 20 for level in levels[4:]), out  # others keep INFO: their debug lines can carry secrets


@pytest.mark.parametrize("argv", [["inspect", "-v", "X"], ["inspect", "--verbose", "X"], ["-v", "inspect", "X"],
                                  ["index", "-v", "X"], ["bench", "storage", "-v", "X"], ["bench", "-v", "storage", "X"],
                                  ["shard", "X", "Y", "-v"], ["doctor", "-v", "--", "true"], ["demo", "-v"]])
def test_verbose_is_accepted_after_the_subcommand_too(argv, monkeypatch):
    from datapipe import cli

    seen = {}
    monkeypatch.setattr(cli, "configure_logging", lambda *, verbose: seen.setdefault("verbose", verbose))
    monkeypatch.setattr(cli, "import_module", lambda name: type("M", (), {"run_command": staticmethod(lambda a: 0),
                                                                         "configure_parser": _real(name)}))
    assert main(argv) == 0
    assert seen["verbose"] is True


def _real(module_name):
    import importlib

    return importlib.import_module(module_name).configure_parser


def test_verbose_defaults_to_off_with_a_subcommand(monkeypatch):
    from datapipe import cli

    seen = {}
    monkeypatch.setattr(cli, "configure_logging", lambda *, verbose: seen.setdefault("verbose", verbose))
    monkeypatch.setattr(cli, "import_module", lambda name: type("M", (), {"run_command": staticmethod(lambda a: 0),
                                                                         "configure_parser": _real(name)}))
    assert main(["bench", "storage", "X"]) == 0
    assert seen["verbose"] is False


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(tmp_path, json_flag):
    """Issue #44: `datapipe inspect ... | head -1` ended in a BrokenPipeError traceback."""
    from tests.shards import write_shards

    write_shards(tmp_path / "d", [3000])  # a preview of every sample: ~0.5 MB, far past a pipe's buffer
    proc = subprocess.Popen([sys.executable, "-m", "datapipe", "inspect", *json_flag, "--preview", "3000",
                             str(tmp_path / "d")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert first and "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
