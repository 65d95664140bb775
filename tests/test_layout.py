"""The package rules of DESIGN.md: light imports and one-way dependencies."""
import ast
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


def _imports(package: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(str(path), a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((str(path), node.module.split(".")[0]))
    return found


def test_dependencies_flow_one_way():
    assert not [p for p, m in _imports("packing") if m in ("datapipe", "loaders")]
    assert not [p for p, m in _imports("datapipe") if m == "loaders"]


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
