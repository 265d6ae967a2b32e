"""The layering of the tree, checked on every test run (ast only: nothing is imported).

Imports run down only: ``flows -> training | tasks -> inference -> storage -> schemas``. A
folder may import the folders of a higher rank, never its own rank or lower (training and tasks
are peers: neither imports the other); ``infra/`` holds scripts, which may import anything, and
nothing imports it. Function-local imports count too. The folders are installed as one package,
``coinrag`` (``coinrag.tasks.chunk``): an import of a bare folder name fails the test.
``KNOWN_UPWARD`` and ``KNOWN_LONG`` list what still breaks a rule; they only shrink: an entry
that is fixed fails the test until it is removed, so the lists stay exact.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RANK = {"flows": 0, "training": 1, "tasks": 1, "inference": 2, "storage": 3, "schemas": 4}
FOLDERS = (*RANK, "infra")
MAX_LINES = 1000
PACKAGE = "coinrag"  # the one installed name: the folders are coinrag.<folder>
# (file, imported module) of the imports that still run against the layers.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# Files over MAX_LINES lines.
KNOWN_LONG: set[str] = set()


def _sources() -> list[Path]:
    return sorted(p for d in FOLDERS for p in (REPO / d).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, function-local ones included; a relative
    import keeps its leading dots."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


def _folder(module: str) -> str | None:
    """The project folder a module lives in (``coinrag.<folder>...``), or None for a
    third-party module."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FOLDERS else None


def test_imports_run_down_only() -> None:
    bad, seen = [], set()
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        src = rel.split("/")[0]
        for line, module in _imports(path):
            if module.startswith("."):
                bad.append(f"{rel}:{line} relative import {module} (use <folder>.<module>)")
                continue
            if module.split(".")[0] in FOLDERS:
                bad.append(f"{rel}:{line} {module} (import it as {PACKAGE}.{module})")
                continue
            dst = _folder(module)
            if dst is None or dst == src:
                continue
            upward = dst == "infra" or (src in RANK and RANK[dst] <= RANK[src])
            if upward and (rel, module) in KNOWN_UPWARD:
                seen.add((rel, module))
            elif upward:
                bad.append(f"{rel}:{line} {src} -> {dst} ({module})")
    stale = sorted(KNOWN_UPWARD - seen)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)
    assert not stale, f"fixed edges still listed in KNOWN_UPWARD, remove them: {stale}"


def test_files_are_small() -> None:
    long = {
        p.relative_to(REPO).as_posix(): n
        for p in _sources()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert set(long) <= KNOWN_LONG, f"over {MAX_LINES} lines: {long}"
    assert KNOWN_LONG <= set(long), (
        f"no longer long, drop from KNOWN_LONG: {KNOWN_LONG - set(long)}"
    )


def test_packaging_lists_every_subpackage() -> None:
    """pyproject.toml installs ``coinrag`` and each folder holding an ``__init__.py`` as
    ``coinrag.<folder>...``: a new subpackage missing from the list would be left out of the
    wheel."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"coinrag"} | {
        "coinrag." + ".".join(p.parent.relative_to(REPO).parts)
        for d in RANK
        for p in (REPO / d).rglob("__init__.py")
    }
    assert listed == found
