"""The subpackages of ``dlm_toolkit`` import each other one way: their graph has no circle.

``tests/test_layout.py`` checks the module graph; a package graph can still circle where no two
modules do (``training.loop`` -> ``sweep.tracking``, ``sweep.uris`` -> ``commands.common``,
``commands.train`` -> ``training.loop``). Every import is counted, function-local ones included
(they run); ``if TYPE_CHECKING:`` blocks are not (they never run). A failure names each edge of one
circle with the file:line of every import that makes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dlm_toolkit"

Edges = dict[str, dict[str, list[str]]]  # package -> imported package -> ["file:line", ...]

# the module graph's reader and cycle finder (tests/test_layout.py), used here on packages
from test_layout import _type_checking_nodes, _write, find_cycle, from_base, module_names as _modules  # noqa: E402


def package_of(module: str, prefix: str) -> str:
    """The first-level subpackage (or flat module) below ``prefix`` that holds ``module``."""
    rest = module[len(prefix) + 1:] if module.startswith(prefix + ".") else ""
    return rest.split(".", 1)[0]


def package_graph(pkg: Path, prefix: str) -> Edges:
    """Edges between the first-level parts of the package, each with the imports that make it.

    ``from dlm_toolkit import decode`` names the package's top level (``""``) unless ``decode`` is a
    subpackage or module there; the top level (``__init__``) itself is left out: it re-exports the
    public names and is imported by everything."""
    modules = _modules(pkg, prefix)
    edges: Edges = {}
    for name, path in modules.items():
        src = package_of(name, prefix)
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, name, path)
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                dst = package_of(target, prefix)
                if not dst or dst == src or not src:
                    continue
                where = f"{path.relative_to(pkg.parent)}:{node.lineno}"
                found = edges.setdefault(src, {}).setdefault(dst, [])
                if where not in found:
                    found.append(where)
    return edges


def describe(cycle: list[str], edges: Edges) -> str:
    """The circle, one edge a line, each with the file:line of the imports that make it."""
    lines = ["package import circle: " + " -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"  {a} -> {b}: " + ", ".join(edges[a][b]))
    return "\n".join(lines)


def circles(edges: Edges) -> list[set[str]]:
    """The strongly connected parts of more than one package (each holds at least one circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph has a few dozen nodes, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = set()
            while True:
                top = stack.pop()
                part.add(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(part)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def describe_all(edges: Edges) -> str:
    """Every edge inside a circle, with the file:line of each import that makes it."""
    lines = []
    for part in circles(edges):
        lines.append("packages in a circle: " + ", ".join(sorted(part)))
        for a in sorted(part):
            for b in sorted(set(edges.get(a, {})) & part):
                lines.append(f"  {a} -> {b}: " + ", ".join(edges[a][b]))
    return "\n".join(lines)


def test_reader_counts_local_and_relative_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = _write(tmp_path / "toy", {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from toy.high import H
            def f():
                from ..mid import b
            """,
        "mid/__init__.py": "from .b import x\n",
        "mid/b.py": "import toy.low.a\n",
        "high/__init__.py": "from toy import mid\n",
    })
    edges = package_graph(pkg, "toy")
    assert edges["low"] == {"mid": ["toy/low/a.py:6"]}  # function-local, relative two levels
    assert edges["mid"] == {"low": ["toy/mid/b.py:1"]}  # own-package import not an edge
    assert edges["high"] == {"mid": ["toy/high/__init__.py:1"]}  # `from toy import mid`
    assert "high" not in edges["low"]  # the TYPE_CHECKING import is not counted
    cycle = find_cycle(edges)
    assert cycle == ["mid", "low", "mid"]  # reached from "high", the first package in order
    assert describe(cycle, edges).splitlines()[1:] == [
        "  mid -> low: toy/mid/b.py:1", "  low -> mid: toy/low/a.py:6"]
    assert circles(edges) == [{"low", "mid"}]
    assert "  high ->" not in describe_all(edges)  # an edge into a circle is not part of it
    del edges["mid"]["low"]  # near miss: no way back
    assert find_cycle(edges) is None and circles(edges) == []


def test_cycle_finder_finds_a_long_circle_and_not_a_diamond() -> None:
    diamond: Edges = {"a": {"b": [], "c": []}, "b": {"d": []}, "c": {"d": []}, "d": {}}
    assert find_cycle(diamond) is None
    ring = {**diamond, "d": {"e": []}, "e": {"c": []}}
    cycle = find_cycle(ring)
    assert cycle is not None and cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["c", "d", "e"]
    assert circles(diamond) == [] and circles(ring) == [{"c", "d", "e"}]


def _without(edges: Edges, packages: set[str]) -> Edges:
    return {a: {b: w for b, w in bs.items() if b not in packages}
            for a, bs in edges.items() if a not in packages}


def test_subpackages_form_no_circle() -> None:
    edges = package_graph(PKG, "dlm_toolkit")
    assert not circles(edges), describe_all(edges)


# The tools above the decode core: commands, sweeps, training and the lm-eval integration. Their
# circle (commands <-> sweep <-> training) is gone; this pins it on its own, whatever happens below.
UPPER = {"commands", "sweep", "training", "integrations", "evaluation", "tasks", "viewer", "cli"}


def test_upper_layers_form_no_circle() -> None:
    edges = package_graph(PKG, "dlm_toolkit")
    upper = {a: {b: w for b, w in bs.items() if b in UPPER} for a, bs in edges.items() if a in UPPER}
    assert not circles(upper), describe_all(upper)
