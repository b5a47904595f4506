"""Nothing in the package reads the process environment to choose what runs.

Kernels are chosen by values a user or test can see (the plan's ``ForwardOptions``, the kernel plan), never by an
environment variable. Every read of ``os.environ`` / ``os.getenv`` (or ``environ`` / ``getenv`` imported from ``os``)
in ``qwen_edit/``, ``fp8/`` and ``nodes/`` is found by parsing the files, and each must be one of :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qwen_edit", "fp8", "nodes")

ALLOWED = {
    # Triton's own interpreter flag, read to know how Triton runs kernels (not a choice of kernels)
    ("fp8/attention/triton_fp8.py", "'TRITON_INTERPRET'"),
}
"""(file, the key's source text) of the environment reads allowed."""


def _environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, key source text or the expression) of each environment read in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()  # names bound to os.environ / os.getenv by ``from os import ...``
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            names |= {alias.asname or alias.name for alias in node.names if alias.name in ("environ", "getenv")}

    def is_environ(expr: ast.AST) -> bool:
        return ((isinstance(expr, ast.Attribute) and expr.attr in ("environ", "getenv")
                 and isinstance(expr.value, ast.Name) and expr.value.id == "os")
                or (isinstance(expr, ast.Name) and expr.id in names))

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            target = func.value if isinstance(func, ast.Attribute) and func.attr in ("get", "pop",
                                                                                      "setdefault") else func
            if is_environ(target):
                reads.append((node.lineno, ast.unparse(node.args[0]) if node.args else ast.unparse(node)))
                continue
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            reads.append((node.lineno, ast.unparse(node.slice)))
        elif isinstance(node, ast.Attribute) and is_environ(node):
            reads.append((node.lineno, "<" + ast.unparse(node) + ">"))
    return reads


def environment_reads() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, key in _environment_reads(path):
                found.setdefault((rel, key), []).append(line)
    return found


def test_the_scan_finds_environment_reads(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom os import getenv as g\n"
                      "A = os.environ.get('X', '1')\nB = os.getenv('Y')\nC = os.environ['Z']\nD = g('W')\n")
    keys = {key for _, key in _environment_reads(sample)}
    assert {"'X'", "'Y'", "'Z'", "'W'"} <= keys


def test_only_the_allowed_reads_remain():
    found = environment_reads()
    keys = {(path, key) for path, key in found}
    unexpected = {k: found[k] for k in keys if k not in ALLOWED and not k[1].startswith("<")}
    assert not unexpected, f"environment reads that may choose what runs: {unexpected}"
    # a bare ``os.environ`` also appears inside each ``os.environ.get(...)``: only those that are part of an allowed
    # read may stay
    bare = {k: lines for k, lines in found.items() if k[1].startswith("<")}
    allowed_lines = {(path, line) for (path, key), lines in found.items() if (path, key) in ALLOWED for line in lines}
    stray = {k: [n for n in lines if (k[0], n) not in allowed_lines] for k, lines in bare.items()}
    assert not any(stray.values()), f"environment accessed outside the allowed reads: {stray}"
    assert keys & ALLOWED == ALLOWED, "an allowed read is gone: update ALLOWED"
