"""``datapipe doctor [--json F] [--plot F.png] -- SCRIPT [ARGS...]``: run a training script under the doctor.

The measurements are :mod:`datapipe.tools.doctor.report` (``datapipe.doctor()``); this command line module
lives in ``loaders`` because it also times the ``loaders`` loaders the script iterates.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import sys
import traceback

from datapipe.tools.doctor.report import Doctor, doctor


# ---- running a script with the doctor installed -----------------------------------------------------------
def _inner_call(frame) -> bool:
    """Whether iter() was called by datapipe / loaders themselves (an inner loader, timed by the outer one)."""
    import datapipe

    roots = [os.path.dirname(os.path.abspath(datapipe.__file__))]
    loaders = sys.modules.get("loaders")
    if loaders is not None and getattr(loaders, "__file__", None):
        roots.append(os.path.dirname(os.path.abspath(loaders.__file__)))
    while frame is not None and frame.f_code.co_name == "__iter__":
        frame = frame.f_back
    name = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return any(name.startswith(r + os.sep) for r in roots)


def install(d: Doctor):
    """Patch ``__iter__`` of torch's DataLoader and the ``loaders`` loaders to time through ``d``; returns undo()."""
    import torch.utils.data

    classes = [torch.utils.data.DataLoader]
    import loaders

    classes += [loaders.DataLoader, loaders.ImageLoader, loaders.TokenLoader]
    saved = []
    for cls in classes:
        original = cls.__dict__["__iter__"]

        def patched(self, _original=original):
            it = _original(self)
            if d._probing or _inner_call(sys._getframe(1)):
                return it
            return d._timed(self, it)

        saved.append((cls, original))
        cls.__iter__ = patched

    def undo():
        for cls, original in saved:
            cls.__iter__ = original

    return undo


_FLAGS = frozenset("-u -O -OO -B -E -s -S -I -q -b -bb -d -v".split())  # python's options without a value
_VALUED = frozenset(("-W", "-X"))  # python's options that take one


def target(script: str, args: list[str]) -> tuple[str, str, list[str]] | str:
    """What to run: ``("path", script, args)`` or ``("module", name, args)``, or a message saying why not.

    A leading ``python`` / ``python3`` (as other profilers take it) is dropped with its own options
    (``-u``, ``-X dev``, ...); ``python -m module`` runs the module."""
    if re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(script)):
        rest = list(args)
        while rest and (rest[0] in _FLAGS or rest[0] in _VALUED or rest[0][:2] in _VALUED):
            flag = rest.pop(0)
            if flag in _VALUED and rest:
                rest.pop(0)
        if rest[:1] == ["-c"]:
            return "python -c is not run under the doctor: put the code in a script"
        if rest[:1] == ["-m"]:
            if len(rest) < 2:
                return "python -m needs a module name"
            if rest[1] in _LAUNCHER_MODULES:
                return _launcher(f"python -m {rest[1]}")
            problem = _module_problem(rest[1])
            return problem if problem else ("module", rest[1], rest[2:])
        if not rest:
            return "give the training script after python"
        script, args = rest[0], rest[1:]
    if not os.path.isfile(script):
        name = os.path.basename(script)
        if name in _LAUNCHERS or (shutil.which(script) and not script.endswith(".py")):
            return _launcher(script)
        return f"no such script: {script}"
    return ("path", script, list(args))


_LAUNCHERS = frozenset(("torchrun", "accelerate", "deepspeed", "mpirun", "srun", "composer", "lightning"))
_LAUNCHER_MODULES = frozenset(("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                               "deepspeed.launcher.runner"))


def _launcher(what: str) -> str:
    return (f"{what} is a program or launcher, not a training script: the doctor runs one training process on its "
            "own (datapipe doctor -- python train.py ARGS, or -- python -m package.train ARGS); under a launcher "
            "such as torchrun, run one process of the job that way")


def _module_problem(name: str) -> str | None:
    """Why ``python -m name`` would run nothing, or None when it would run a module."""
    import importlib.util

    missing = f"no such module: {name} (python -m looks in the current folder and sys.path)"
    sys.path.insert(0, os.getcwd())  # as python -m sees it
    try:
        spec = importlib.util.find_spec(name)
        if spec is None:
            return missing
        if spec.submodule_search_locations is not None and importlib.util.find_spec(name + ".__main__") is None:
            return f"{name} is a package without a __main__ module: give the module that trains ({name}.train?)"
        return None
    except (ImportError, ValueError):
        return missing
    finally:
        sys.path.pop(0)


def run_script(d: Doctor, script: str, args: list[str]) -> int:
    """Run ``script`` (see :func:`target`) as ``__main__`` with ``args`` under the doctor; returns its exit status."""
    what = target(script, args)
    if isinstance(what, str):
        print(f"datapipe doctor: {what}", file=sys.stderr)
        return 1
    kind, name, args = what
    undo = install(d)
    argv, path0 = sys.argv[:], list(sys.path)
    sys.argv = [name] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(name)) if kind == "path" else os.getcwd())
    code = 0
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.argv, sys.path[:] = argv, path0
        undo()
    d.finish()
    return code


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write the report as JSON here")
    parser.add_argument("--plot", default=None, help="PNG of data wait over time (default: next to --json)")
    parser.add_argument("--probe-capacity", action="store_true",
                        help="at the end, pull batches without a consumer to measure the input capacity")
    parser.add_argument("--probe-seconds", type=float, default=2.0,
                        help="how long --probe-capacity pulls batches (default 2 s)")
    parser.add_argument("--ceiling-steps", type=int, default=0,
                        help="after 5 batches, hand the 5th to the script N more times and time those steps: "
                             "the data-free rate of the same step. This adds N training steps on a repeated batch "
                             "to your run (optimizer steps, counters and sample counts include them; the report "
                             "says so); reported as the loaded / data-free step-rate ratio")
    parser.add_argument("script", help="the training script (put -- before it)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def run_command(args: argparse.Namespace) -> int:
    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    d = doctor(report=args.json, plot=args.plot, probe_capacity=args.probe_capacity, probe_seconds=args.probe_seconds,
               ceiling_steps=args.ceiling_steps)
    return run_script(d, args.script, script_args)
