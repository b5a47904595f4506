"""The repository speaks of itself only, and its docs point at files that exist.

(a) No word about how the work was organised: the words NARRATION matches appear only inside pytest's fixture
    scope (``scope="session"``) and subprocess's ``start_new_session``.
(b) No reference to files outside the repository (a shared folder, notes kept elsewhere).
(c) Every repository path that README.md and docs/ mention (``bench/harness.py``, relative links such as
    ``decisions/README.md``) exists.
(d) bench/ holds at most 13 files: the GPU harness and the product-path tools; experiments live elsewhere.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
SKIPPED_DIRS = {".git", ".testenv", ".ruff_cache", "__pycache__", "node_modules", ".pytest_cache", "out", "prior",
                ".whl", ".comfy_src", ".tew"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".json", ".yaml", ".yml", ".cfg", ".ini", ".js", ".html"}

ALLOWED_SESSION = ('scope="session"', "scope='session'", "start_new_session")
NARRATION = re.compile(r"\bsession\b|\bthe lead\b|\bsitting\b", re.IGNORECASE)
OUTSIDE = ("../shared", "shared/docs", "/work/", "anchors.md", "KINDS.md", "gpu-device.md")

TOP_LEVEL = ("bench", "docs", "fp8", "qwen_edit", "nodes", "tests", "scripts", "example_workflows")
REPO_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./-]*[\w/])")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _candidates() -> list[Path]:
    """The repository's files: what git tracks or would add (ignored folders such as runs/ left out); without git,
    every file outside :data:`SKIPPED_DIRS`."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True, timeout=60).stdout.decode()
        return [ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        return [path for path in ROOT.rglob("*")
                if not any(part in SKIPPED_DIRS for part in path.relative_to(ROOT).parts[:-1])]


def _text_files() -> list[Path]:
    return [path for path in _candidates()
            if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in ("LICENSE",)) and path != THIS]


def _lines(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    yield from enumerate(text.splitlines(), 1)


def test_no_narration_of_how_the_work_was_done():
    found = []
    for path in _text_files():
        for number, line in _lines(path):
            stripped = line
            for allowed in ALLOWED_SESSION:
                stripped = stripped.replace(allowed, "")
            if NARRATION.search(stripped):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "narration of the work (say what the pack does, measured how):\n" + "\n".join(found)


def test_no_reference_outside_the_repository():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
             for path in _text_files() for number, line in _lines(path) if any(o in line for o in OUTSIDE)]
    assert not found, "references to files outside the repository:\n" + "\n".join(found)


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _mentioned_paths(doc: Path) -> set[tuple[str, Path]]:
    """(as written, resolved) for every repository path and relative markdown link in ``doc``."""
    text = doc.read_text(encoding="utf-8")
    found = set()
    for match in REPO_PATH.finditer(text):
        written = match.group(1).rstrip(".")
        if "<" in written or "*" in written or written.startswith("bench/out"):
            continue  # placeholders, patterns, and the harness's output folder (ignored, made by a run)
        found.add((written, ROOT / written))
    for match in MARKDOWN_LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target) or "<" in target:
            continue
        found.add((target, (doc.parent / target).resolve()))
    return found


def test_every_path_the_docs_mention_exists():
    missing = [f"{doc.relative_to(ROOT)}: {written}" for doc in _doc_files()
               for written, path in sorted(_mentioned_paths(doc)) if not path.exists()]
    assert not missing, "paths named in README.md / docs/ that do not exist:\n" + "\n".join(missing)


def test_the_path_check_sees_paths():
    """The check above must find what it checks: the README links the design, the docs name the harness."""
    assert "docs/design.md" in {w for w, _ in _mentioned_paths(ROOT / "README.md")}
    assert "bench/harness.py" in {w for doc in _doc_files() for w, _ in _mentioned_paths(doc)}


def test_bench_holds_the_harness_and_the_product_path_only():
    files = sorted(p.name for p in (ROOT / "bench").iterdir() if p.is_file() and not p.name.startswith("."))
    assert len(files) <= 13, f"bench/ has {len(files)} files (at most 13): {files}"
    assert "harness.py" in files and "product_path.py" in files
