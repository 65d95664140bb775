"""The package rules of DESIGN.md: light imports and one-way dependencies."""
import ast
import re
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_import_pulls_in_no_heavy_optional_dependency():
    code = ("import sys, datapipe, loaders, packing\n"
            "for name in ('DataError', 'expand_urls', 'ShardStream', 'ShardWriter', 'DevicePrefetcher', 'mix'):\n"
            "    getattr(datapipe, name)\n"
            "heavy = [m for m in ('nvidia.dali', 'ray', 's3fs') if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import pulled in {out.stdout.strip()}"


PACKAGES = ("packing", "datapipe", "loaders")
# layers: the engine (datapipe minus its jobs and tools) and packing at the bottom, loaders above,
# jobs and tools (datapipe.jobs, datapipe.tools) on top
LAYERS = ("packing", "engine", "loaders", "jobs", "tools")
ALLOWED = {
    "packing": {"packing"},
    "engine": {"engine"},
    "loaders": {"engine", "packing", "loaders"},
    "jobs": {"engine", "packing", "jobs"},
    "tools": {"engine", "packing", "loaders", "jobs", "tools"},
}
# the one upward reference DESIGN.md allows: the CLI entry point dispatches to a tool or job by name
DISPATCH = {"datapipe/cli.py": {"tools", "jobs"}}
MODULE_NAME = re.compile(r"^(%s)(\.\w+)+$" % "|".join(PACKAGES))


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] == "datapipe":
        return parts[1] if len(parts) > 1 and parts[1] in ("jobs", "tools") else "engine"
    return parts[0]


def _files():
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Modules ``path`` imports: import statements anywhere (lazy ones too) and import_module strings."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
            found.add(node.value)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = {_module_of(p): p for p in _files()}
    graph = {}
    for mod, path in files.items():
        graph[mod] = {m if m in files else m.rsplit(".", 1)[0] for m in _imports(path)} & set(files) - {mod}
    return graph


def test_dependencies_flow_one_way():
    wrong = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        layer = layer_of(_module_of(path))
        allowed = ALLOWED[layer] | DISPATCH.get(rel, set())
        wrong += [f"{rel} imports {m}" for m in sorted(_imports(path)) if layer_of(m) not in allowed]
    assert not wrong, "imports against the layout (see docs/internals.md):\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(mod, stack):
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    # package __init__ files re-export lazily by name; the CLI dispatches by name: neither is a real cycle
    cycles = [c for c in cycles if not any(m in ("datapipe", "loaders", "packing", "datapipe.cli") for m in c.split(" -> "))]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_only_the_entry_point_imports_the_cli():
    # the CLI dispatches to every job and tool by name, so a job or tool that calls the CLI closes a circle
    # (the cycle test above lets datapipe.cli through for its dispatch): call the job's own function instead
    callers = [p.relative_to(ROOT).as_posix() for p in _files()
               if "datapipe.cli" in _imports(p) and p.relative_to(ROOT).as_posix() != "datapipe/__main__.py"]
    assert not callers, "modules that import the CLI entry point:\n" + "\n".join(callers)


def test_the_layout_test_sees_lazy_and_by_name_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    import datapipe.tools.demo\n    return __import__('importlib').import_module('loaders.tokens')\n")
    assert _imports(mod) == {"datapipe.tools.demo", "loaders.tokens"}


def test_public_names_exist():
    import datapipe
    import loaders
    import packing

    for name in ("expand_urls", "ShardStream", "mix", "DataError", "ShardWriter", "DevicePrefetcher"):
        assert callable(getattr(datapipe, name))
    for name in ("DataLoader", "ImageLoader", "TokenLoader"):
        assert callable(getattr(loaders, name))
    for name in ("pack_lengths", "Packer", "TokenBudgetBatcher"):
        assert callable(getattr(packing, name))


def test_every_stateful_stage_names_its_kind_and_refuses_another(tmp_path):
    """The state contract (datapipe/state.py): states say what they are; a foreign one is refused clearly."""
    import pytest

    from datapipe import ShardStream, mix
    from packing import Packer
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "d", [4, 4])
    stream, mixed, packer = ShardStream(urls), mix([ShardStream(urls)], weights=[1.0]), Packer(16, buffer_size=4)
    for stage, kind in ((stream, "ShardStream"), (mixed, "Mix"), (packer, "Packer")):
        assert stage.state_dict()["kind"] == kind
    with pytest.raises(ValueError, match="this is a Mix state, not a ShardStream state"):
        stream.load_state_dict(mixed.state_dict())
    with pytest.raises(ValueError, match="not a Packer state"):
        packer.load_state_dict(stream.state_dict())


def test_import_changes_no_environment_variable_and_starts_no_thread():
    """No work at import (DESIGN.md): importing the packages writes no variable and starts no thread."""
    code = ("import os, threading, json\n"
            "env, threads = dict(os.environ), {t.ident for t in threading.enumerate()}\n"
            "import datapipe, loaders, packing, loaders.images, loaders.images.loader, loaders.tokens, loaders.dataloader\n"
            "for name in ('DataError', 'expand_urls', 'ShardStream', 'ShardWriter', 'DevicePrefetcher', 'mix'):\n"
            "    getattr(datapipe, name)\n"
            "for name in ('DataLoader', 'ImageLoader', 'TokenLoader'):\n"
            "    getattr(loaders, name)\n"
            "changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))\n"
            "started = [t.name for t in threading.enumerate() if t.ident not in threads]\n"
            "print(json.dumps({'changed': changed, 'started': started}))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"changed": [], "started": []}


# ---- packaging: three top-level packages, optional dependencies as extras --------------------------------------
EXTRA_MODULES = ("nvidia.dali", "ray", "s3fs", "skimage", "transformers", "tokenizers", "pyarrow")
BLOCK_EXTRAS = ("import sys\n"
                "class _Block:\n"
                "    def find_spec(self, name, path=None, target=None):\n"
                f"        if any(name == m or name.startswith(m + '.') for m in {EXTRA_MODULES!r}):\n"
                "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                "sys.meta_path.insert(0, _Block())\n")


def _installed_copy(tmp_path) -> pathlib.Path:
    """``pip install --no-deps --no-build-isolation`` of a copy of the checkout (builds leave the checkout alone)
    into a target folder; returns the folder."""
    import shutil

    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("datapipe", "loaders", "packing"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return target


def test_pip_install_puts_only_three_packages_at_the_top_and_help_needs_no_extra(tmp_path):
    target = _installed_copy(tmp_path)
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")) and p.name != "bin")
    assert top == ["datapipe", "loaders", "packing"]
    assert (target / "datapipe" / "jobs" / "shard" / "job.py").exists()
    assert (target / "datapipe" / "tools" / "doctor" / "cli.py").exists()
    from datapipe.cli import COMMANDS

    code = BLOCK_EXTRAS + (
        "import contextlib, io\nfrom datapipe.cli import main\n"
        f"for argv in [['--help']] + [[c, '--help'] for c in {sorted(COMMANDS)!r}]:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (argv, e.code)\n"
        "    assert 'usage: datapipe' in buf.getvalue(), argv\n"
        "import datapipe\nassert datapipe.__file__.startswith(sys.argv[1]), datapipe.__file__\n"
        f"print('loaded:', [m for m in {EXTRA_MODULES!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(target)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "loaded: []"


def test_the_generator_is_an_extra_and_scikit_image_is_not_a_requirement():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    required = cfg["options"]["install_requires"]
    extras = cfg["options.extras_require"]
    assert "scikit-image" not in required and "scikit-image" in extras["synthetic"]
    assert "scikit-image" in extras["test"]  # the tests make images with the generator
    assert "synthetic" in (ROOT / "scripts" / "setup-venv.sh").read_text()  # the demo and test scripts install it


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    import pytest

    from datapipe.extras import EXTRAS, MissingExtra, require

    for module in ("nvidia.dali", "ray", "s3fs", "skimage", "transformers"):
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(MissingExtra) as info:
            require(module, what="X")
        assert str(info.value) == f"X needs the extra {EXTRAS[module]}: pip install 'datapipe[{EXTRAS[module]}]'"
    from importlib import import_module

    from datapipe.storage.files import filesystem
    from datapipe.tools.synthetic import iter_image_samples

    for protocol in ("s3", "s3a"):  # an earlier test may have imported s3fs: fsspec keeps its class
        monkeypatch.delitem(import_module("fsspec.registry")._registry, protocol, raising=False)
    with pytest.raises(MissingExtra, match=r"^s3:// URLs needs the extra s3: pip install 'datapipe\[s3\]'$"):
        filesystem("s3://bucket/shards")
    monkeypatch.setitem(sys.modules, "skimage.data", None)
    with pytest.raises(MissingExtra, match=r"synthetic image generator .* pip install 'datapipe\[synthetic\]'$"):
        next(iter_image_samples(1))
    with pytest.raises(ValueError, match="not an optional dependency"):
        require("numpy", what="X")


def test_a_command_without_its_extra_says_which_to_install(tmp_path):
    code = BLOCK_EXTRAS + "from datapipe.cli import main\nsys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "demo", "--data", str(tmp_path / "d"), "--images", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == ("datapipe demo: the synthetic image generator (datapipe demo, "
                                                   "datapipe bench) needs the extra synthetic: "
                                                   "pip install 'datapipe[synthetic]'")
    assert "Traceback" not in out.stderr


def test_loaders_are_three_sibling_packages():
    """DESIGN.md: loaders/ holds dataloader/, images/ and tokens/ (plus the source both read through), no flat
    loader modules beside them."""
    packages = sorted(p.parent.name for p in (ROOT / "loaders").glob("*/__init__.py"))
    assert packages == ["dataloader", "images", "tokens"]
    flat = sorted(p.name for p in (ROOT / "loaders").glob("*.py"))
    assert flat == ["__init__.py", "source.py"], f"flat modules beside the loader packages: {flat}"
