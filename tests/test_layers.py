"""Imports point down the layers of DESIGN.md, no fulmen module imports itself back (no cycles, no
imports inside functions to hide one); `import fulmen` needs only torch, numpy, networkx."""

import ast
import pathlib
import subprocess
import sys

import networkx as nx

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


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: pathlib.Path = PACKAGE) -> tuple[nx.DiGraph, list[str]]:
    """Module -> fulmen module it imports (`from a.b import c` names the module `a.b.c` when
    there is one, else `a.b`), at module level or not; and the imports made inside functions
    (`file:line imports module`)."""
    files = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph, inside = nx.DiGraph(), []
    for name, path in files.items():
        graph.add_node(name)
        tree = ast.parse(path.read_text())
        nested = {id(node) for function in ast.walk(tree)
                  if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for node in ast.walk(function) if node is not function}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files
                           else node.module for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != "fulmen":
                    continue
                graph.add_edge(name, target)
                if id(node) in nested:
                    inside.append(f"{path.relative_to(package.parent)}:{node.lineno} imports "
                                  f"{target}")
    return graph, inside


def import_cycles(package: pathlib.Path = PACKAGE) -> list[list[str]]:
    return [sorted(cycle) for cycle in nx.simple_cycles(import_graph(package)[0])]


def test_no_import_cycles():
    assert import_cycles() == []


def test_no_fulmen_import_inside_a_function():
    assert import_graph()[1] == []


def test_checker_detects_a_cycle_and_an_import_inside_a_function(tmp_path):
    fake = tmp_path / "fulmen"
    (fake / "tools").mkdir(parents=True)
    (fake / "tools" / "__init__.py").write_text("")
    (fake / "tools" / "a.py").write_text("from fulmen.tools import b\n")
    (fake / "tools" / "b.py").write_text("def f():\n    from fulmen.tools.a import x\n")
    assert import_cycles(fake) == [["fulmen.tools.a", "fulmen.tools.b"]]
    assert import_graph(fake)[1] == ["fulmen/tools/b.py:2 imports fulmen.tools.a"]


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
