"""`datapipe bench WHAT --help` describes each sub-command, as the other commands' help does."""
import argparse

import pytest

from datapipe.tools.bench.loader_cli import configure_parser


def _subcommands():
    parser = argparse.ArgumentParser(prog="datapipe bench")
    configure_parser(parser)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_bench_subcommand_has_a_description():
    subs = _subcommands()
    assert set(subs) >= {"storage", "loader"}
    for name, p in subs.items():
        assert p.description and len(p.description) > 40, f"bench {name} --help has no description"


def test_bench_storage_help_says_what_it_measures(capsys):
    from datapipe.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "storage", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "How fast your storage serves shards" in out and "concurrency x block-size" in out


def test_bench_loader_help_says_which_images_it_takes(capsys):
    """It said "jpg+cls"; the loader bench reads every image type `datapipe shard` writes (#44)."""
    from datapipe.cli import main
    from datapipe.image_bytes import IMAGE_ENTRIES

    with pytest.raises(SystemExit):
        main(["bench", "loader", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "jpg+cls" not in out and all(ext in out for ext in IMAGE_ENTRIES) and "cls" in out
