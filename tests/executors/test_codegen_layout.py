"""The codegen executor is a package DAG (issue 17): its modules import each other without a
cycle, only at module level, and nothing in it imports the claim pass (a region's fallback is
handed in)."""

import ast
import pathlib

import networkx as nx

import fulmen.executors.codegen as codegen

ROOT = pathlib.Path(codegen.__file__).parent
PACKAGE = "fulmen.executors.codegen"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _imported(node: ast.AST, modules: set[str]) -> list[str]:
    """The fulmen modules an import statement loads (`from pkg import sub`: the submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("fulmen")]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fulmen"):
        subs = [f"{node.module}.{alias.name}" for alias in node.names]
        found = [sub for sub in subs if sub in modules]
        return found if len(found) == len(subs) else [node.module, *found]
    return []


def _graph() -> tuple[nx.DiGraph, list[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(path) for path in files}
    graph, nested = nx.DiGraph(), []
    for path in files:
        name = _module_name(path)
        graph.add_node(name)
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            for target in _imported(node, modules):
                if id(node) not in top:
                    nested.append(f"{name} imports {target} inside a function")
                if target in modules and target != name:
                    graph.add_edge(name, target)
                else:
                    graph.add_node(target)
                    graph.add_edge(name, target)
    return graph, nested


def test_codegen_modules_form_a_dag():
    graph, _ = _graph()
    inside = graph.subgraph(n for n in graph if n.startswith(PACKAGE))
    assert list(nx.simple_cycles(inside)) == []


def test_codegen_imports_only_at_module_level():
    _, nested = _graph()
    assert nested == []


def test_codegen_never_imports_the_claim_pass():
    graph, _ = _graph()
    assert not any(target == "fulmen.executors.claim" for _, target in graph.edges)
