"""The import structure of the tandem package: the layer contracts of pyproject.toml, and no import cycles.

`make lint` runs the same contracts (`lint-imports`); this test keeps `make test` honest too and adds what
import-linter's contracts cannot say for the whole package at once: no two modules import each other, directly
or through others. Imports inside functions count (grimp sees them): a lazy import is still a dependency.
"""
from __future__ import annotations

from pathlib import Path

import grimp     # comes with import-linter (the test extra)
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("tandem", cache_dir=None)


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), sorted."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(root: str) -> None:      # Tarjan's algorithm, iterative (the graph is deep enough to matter)
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in edges[v]:
                    cycles.append(sorted(comp))

    for m in edges:
        if m not in index:
            visit(m)
    return sorted(cycles)


def _describe(graph, cycle: list[str]) -> str:
    lines = [" <-> ".join(cycle)]
    members = set(cycle)
    for a in cycle:
        for b in sorted(graph.find_modules_directly_imported_by(a) & members):
            for d in graph.get_import_details(importer=a, imported=b):
                lines.append(f"    {a}:{d['line_number']}: {d['line_contents']}")
    return "\n".join(lines)


def test_cycle_finder_finds_cycles():
    """Protects: the cycle check itself (a graph with a known cycle and a known acyclic part)."""
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    g.add_import(importer="p.c", imported="p.a")
    g.add_import(importer="p.d", imported="p.a")
    assert import_cycles(g) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles(graph):
    """Protects: no module of tandem imports itself back through others (function-local imports included)."""
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_layer_contracts_hold():
    """Protects: the layer rule (cli > bench > server > runtime > plan > sim | engine > core > policy > perf >
    workload) and the cycle-free layouts of tandem.cli, tandem.engine.attention and tandem.engine.models."""
    import logging

    from importlinter.cli import lint_imports

    # lint_imports configures logging with dictConfig, which disables every logger that exists already (other
    # tests' caplog would then see nothing): put them back as they were
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = [lg.disabled for lg in loggers]
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0, \
            "lint-imports failed: run .venv/bin/lint-imports for the broken contract and the offending imports"
    finally:
        for lg, was in zip(loggers, disabled):
            lg.disabled = was



def test_no_private_name_is_imported_from_another_module():
    """Protects module boundaries: a name with a leading underscore is its module's own; tandem, its tests and its
    benchmarks import only public names from tandem modules."""
    import ast

    found = []
    for path in [*ROOT.joinpath("tandem").rglob("*.py"), *ROOT.joinpath("tests").glob("*.py"),
                 *ROOT.joinpath("benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tandem"):
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []
