"""The ``datapipe`` command line: ``shard``, ``index``, ``inspect``, ``bench``, ``doctor``, ``demo``.

Each subcommand lives in its own module, which provides ``configure_parser(parser)`` and
``run_command(args) -> int`` (the exit status). Logs go to stderr; results to stdout. Commands that
drive the loaders live in the ``loaders`` package (``datapipe`` never imports it statically).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import import_module

COMMANDS = {
    "shard": ("datapipe.jobs.shard.cli", "convert image folders, CSV/JSONL image lists, JSONL/Parquet text or tars into WebDataset shards"),
    "index": ("datapipe.tar.dali_index", "write DALI index files (wds2idx format) for shards"),
    "inspect": ("datapipe.tools.inspect", "summarise shards or a shard directory; exit 1 on corrupt shards"),
    "bench": ("datapipe.tools.bench.loader_cli", "measure storage and loader throughput"),
    "doctor": ("datapipe.tools.doctor.cli", "run a training script and report where its step time goes"),
    "demo": ("datapipe.tools.demo", "make a small real dataset and stream it through the loaders"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="datapipe", description="Keeps GPUs fed: shards, loaders, benchmarks.")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only == name:
            import_module(module).configure_parser(p)
        _accept_verbose(p)
    return parser


VERBOSE_HELP = "debug logging (datapipe's own loggers)"


def _accept_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v/--verbose`` after a subcommand (at any depth) too, with the same meaning as before it."""
    if not any("--verbose" in a.option_strings for a in parser._actions):
        # SUPPRESS: absent here, the top-level value (or its default) stands
        parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _accept_verbose(child)


def chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest sub-command parser that ``args`` went through (``parser`` itself when none)."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, action.dest, None) if action is not None else None
        if name not in (action.choices if action is not None else ()):
            return parser
        parser = action.choices[name]


OWN_LOGGERS = ("datapipe", "loaders", "packing")


class RedactingFormatter(logging.Formatter):
    """Log lines (tracebacks included) with credentials in URLs redacted, whichever library wrote them."""

    def format(self, record: logging.LogRecord) -> str:
        from datapipe.storage.urls import redact_text

        return redact_text(super().format(record))


def configure_logging(*, verbose: bool) -> None:
    """INFO to stderr; ``verbose`` turns DEBUG on for datapipe's own loggers only (other libraries keep their
    levels: their debug lines can carry URLs with credentials)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    if verbose:
        for name in OWN_LOGGERS:
            logging.getLogger(name).setLevel(logging.DEBUG)


def _stdout_closed() -> int:
    """The reader of stdout went away (``datapipe inspect ... | head -1``): exit 0 quietly, as other command-line
    tools do; stdout goes to /dev/null so that Python's flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor behind sys.stdout (captured)
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if extra:  # the usage of the (sub)command they were given to, not the top level's
        chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging(verbose=args.verbose)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from datapipe.extras import MissingExtra
    from datapipe.storage.urls import redact_text

    try:
        status = int(import_module(COMMANDS[args.command][0]).run_command(args) or 0)
        sys.stdout.flush()  # a reader that closed early (`| head`) is found here, not at exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        return 130
    except MissingExtra as e:  # one line naming the extra to install
        print(f"datapipe {args.command}: {redact_text(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
