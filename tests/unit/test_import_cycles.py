"""The package's own modules import each other without cycles.

Rule: module A depends on module B when A has an import statement naming B, or naming a name that B defines
(``from .b import x``, ``from . import b``), anywhere in A: at the top, or inside a function or method. A function-level
import still ties the two modules together, so it counts. Imports under ``if TYPE_CHECKING:`` count not: they never
run. Importing ``a.b`` also runs the package ``a/__init__.py``; that implicit edge is not counted (a package's
``__init__`` re-exporting its own modules would otherwise be a cycle by construction). Only the pack's modules
(``qwen_edit``, ``fp8``, ``nodes``) are nodes of the graph. The test fails with every cycle found, as module lists.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qwen_edit", "fp8", "nodes")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, is_package)
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def _targets(module: str, is_package: bool, node: ast.AST, modules: dict) -> set[str]:
    """The pack's modules an import node names (relative imports resolved against ``module``)."""
    if isinstance(node, ast.Import):
        names = [alias.name.removeprefix("qwen_edit_hopper.") for alias in node.names]
        return {name for name in names if name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level == 0:
        base = (node.module or "").removeprefix("qwen_edit_hopper.")
    else:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    found = set()
    for alias in node.names:
        candidate = f"{base}.{alias.name}" if base else alias.name
        if candidate in modules:
            found.add(candidate)
        elif base in modules:
            found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) not in skipped:
                graph[name] |= _targets(name, is_package, node, modules) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_must():
    """The parser finds top-level, relative, function-level and package imports (else an empty graph would pass)."""
    graph = import_graph()
    assert "qwen_edit.fast.block" in graph["qwen_edit.fast.kernel_plan"]  # top-level relative
    assert "qwen_edit.fast.prepared" in graph["qwen_edit.runtime"]  # inside a method
    assert "fp8.attention.cudnn_fp8" in graph["fp8.attention.backends"]
    assert "qwen_edit.checkpoints.dit_model" in graph["qwen_edit.checkpoints.dit"]  # function-level
    assert "qwen_edit.checkpoints.dit" not in graph["qwen_edit.checkpoints.dit_model"]  # TYPE_CHECKING only


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
