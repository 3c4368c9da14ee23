"""Imports point down the layers of DESIGN.md; `import fulmen` needs only torch, numpy, networkx."""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fulmen"
# `config` (fulmen/config.py, the FULMEN_* environment variables) imports nothing of fulmen
LAYERS = ["config", "core", "proxies", "ops", "tracer", "transforms", "executors"]
TOP = len(LAYERS)  # jit.py, extend.py, __init__.py


def _layer_of_module(dotted: str) -> int | None:
    parts = dotted.split(".")
    if parts[0] != "fulmen":
        return None
    if len(parts) == 1 or parts[1] not in LAYERS:
        return TOP
    return LAYERS.index(parts[1])


def _layer_of_file(path: pathlib.Path, package: pathlib.Path) -> int:
    top = path.relative_to(package).parts[0].removesuffix(".py")
    return LAYERS.index(top) if top in LAYERS else TOP


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module == "fulmen" and node.level == 0:
            for alias in node.names:  # `from fulmen import config`: the module it names
                yield node.lineno, f"fulmen.{alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def upward_imports(package: pathlib.Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        own = _layer_of_file(path, package)
        for lineno, module in _imports(path):
            target = _layer_of_module(module)
            if target is not None and target > own:
                found.append(f"{path.relative_to(package.parent)}:{lineno} imports {module}")
    return found


def test_no_import_points_up_the_layers():
    assert upward_imports() == []


def test_checker_detects_an_upward_import(tmp_path):
    fake = tmp_path / "fulmen"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("def f():\n    from fulmen.tracer import x\n")
    assert upward_imports(fake) == ["fulmen/core/bad.py:2 imports fulmen.tracer"]


def test_import_fulmen_needs_only_core_dependencies():
    code = (  # what fulmen imports beyond what torch itself imports
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import fulmen\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "optional = ['transformers', 'nvfuser', 'nvfuser_direct', 'cuda', 'matplotlib', "
        "'pygments', 'litgpt']\n"
        "print([m for m in optional if m in new])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
