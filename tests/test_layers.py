"""The import graph keeps the layers of docs/design.md ("One direction of data flow"): every
module under src/exactspec is parsed (its AST, not imported), mapped to its row of the
layer table in that page, and each of its imports (at module level, in a function, or for
type checking alone) must reach its own layer or one below; and the graph has no circle.

An import names the module it reaches: ``from exactspec.backends import native`` reaches
``exactspec.backends.native``; ``from exactspec.backends import Backend`` reaches the
package's ``__init__``. The parent packages Python runs on the way (``exactspec``'s own
``__init__`` before any submodule) are not edges: those ``__init__`` modules import their
names on first use (PEP 562) and stay in their own layer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = "exactspec"


def layer_table(text: str) -> dict[str, int]:
    """The layer table of docs/design.md: each backticked name of a row → its layer. A
    module's name (``generator``, ``proposers/base``) is that module; a package's
    (``backends/``) is every module in it, keyed ``exactspec.backends.*``; ``__init__`` is
    the package's own ``exactspec/__init__.py``."""
    layers = {}
    for row in re.finditer(r"^\| (\d+) \| (.+?) \|", text, re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", row.group(2)):
            dotted = name.rstrip("/").replace("/", ".")
            key = PACKAGE if dotted == "__init__" else f"{PACKAGE}.{dotted}"
            layers[key + (".*" if name.endswith("/") else "")] = int(row.group(1))
    return layers


def modules(source: Path) -> dict[str, Path]:
    """Every module of the package under ``source`` by dotted name (a package by its own)."""
    found = {}
    for path in sorted((source / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of ``module`` in the table, else of the innermost package holding it."""
    if module in layers:
        return layers[module]
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) + ".*" in layers:
            return layers[".".join(parts[:end]) + ".*"]
    return None


def imports(module: str, path: Path, known: set[str]) -> dict[str, int]:
    """The package's modules that ``module`` imports (anywhere in it) → the line of the first
    such import."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    reached: dict[str, int] = {}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            for alias in node.names:  # a submodule, else a name of origin's __init__
                targets.append(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known
                               else origin)
        for target in targets:
            while target not in known and "." in target:  # import a.b.c of a module a.b
                target = target.rpartition(".")[0]
            if target in known and target != module:
                reached.setdefault(target, node.lineno)
    return reached


def check(source: Path, layers: dict[str, int]) -> list[str]:
    """What breaks the layering under ``source``: an unmapped module, an import of a higher
    layer, a circle. Empty when the graph is clean."""
    found = modules(source)
    problems = [f"{name} is in no row of the layer table" for name in found
                if layer_of(name, layers) is None]
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    for name, reached in graph.items():
        own = layer_of(name, layers)
        for target, line in reached.items():
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs > own:
                problems.append(f"{name} (layer {own}) imports {target} (layer {theirs}), "
                                f"line {line}")
    problems += [f"circle among {', '.join(circle)}" for circle in circles(graph)]
    return problems


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted:
    every module of one imports every other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_keeps_the_layer_table():
    problems = check(SOURCE, layer_table(DESIGN.read_text()))
    assert not problems, "\n".join(problems)


def test_the_layer_table_has_every_layer_in_order():
    layers = layer_table(DESIGN.read_text())
    assert sorted(set(layers.values())) == list(range(1, max(layers.values()) + 1))
    assert layers[f"{PACKAGE}.cli.*"] == max(layers.values())  # the command line on top


@pytest.fixture
def broken_tree(tmp_path):
    """A package with an upward import in a function (``sampling``, layer 1, imports the
    generator), hence a circle, and a module in no row."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sampling.py").write_text(
        "def later():\n    from exactspec.generator import SpeculativeGenerator\n")
    (package / "generator.py").write_text("import exactspec.sampling\n")
    (package / "engines.py").write_text("from . import generator\n")
    (package / "stray.py").write_text("")
    return tmp_path


def test_the_check_reports_an_upward_import_a_circle_and_an_unmapped_module(broken_tree):
    """The control: the check is not blind."""
    problems = check(broken_tree, layer_table(DESIGN.read_text()))
    assert sorted(problems) == [
        "circle among exactspec.generator, exactspec.sampling",
        "exactspec.sampling (layer 1) imports exactspec.generator (layer 6), line 2",
        "exactspec.stray is in no row of the layer table"], problems


def test_relative_and_dotted_imports_reach_the_module(tmp_path):
    package = tmp_path / PACKAGE / "proposers"
    package.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "generator.py").write_text("")
    (package / "__init__.py").write_text("from .base import Proposer\n")
    (package / "base.py").write_text("import exactspec.generator.something\n")
    found = modules(tmp_path)
    assert imports("exactspec.proposers", found["exactspec.proposers"], set(found)) == {
        "exactspec.proposers.base": 1}
    assert imports("exactspec.proposers.base", found["exactspec.proposers.base"],
                   set(found)) == {"exactspec.generator": 1}
