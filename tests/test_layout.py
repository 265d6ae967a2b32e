"""The layering of the tree, checked on every test run (ast only: nothing is imported).

Imports run down only: ``flows -> training | tasks -> inference -> storage -> schemas``. A
folder may import the folders of a higher rank, never its own rank or lower (training and tasks
are peers: neither imports the other); ``infra/`` holds scripts, which may import anything, and
nothing imports it. Function-local imports count too. The folders are installed as one package,
``coinrag`` (``coinrag.tasks.chunk``): an import of a bare folder name fails the test.
``KNOWN_UPWARD`` and ``KNOWN_LONG`` list what still breaks a rule; they only shrink: an entry
that is fixed fails the test until it is removed, so the lists stay exact.

Inside a folder the same rule holds between its levels (``LEVELS``, top to bottom): its rooms
(subfolders) and groups of its own modules (``HALL_GROUPS``; the rest of them are level "").
A module imports its own level and the levels below it, never one above. No folder or room
holds more than ``MAX_MODULES`` modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RANK = {"flows": 0, "training": 1, "tasks": 1, "inference": 2, "storage": 3, "schemas": 4}
FOLDERS = (*RANK, "infra")
# Each folder's levels, top to bottom: its rooms (subfolders) and groups of its own modules
# (``HALL_GROUPS``; "" is the rest of them). A module imports only its level and those after it.
LEVELS = {
    "inference": (
        "",
        "server",
        "evaluation",
        "methods",
        "context",
        "retrieval",
        "model",
        "rope",
        "llm",
    ),
    "storage": ("", "index", "kv", "base"),
    "tasks": (
        "",
        "retrieval",
        "recover",
        "chunking",
        "extractors",
        "question_generators",
        "readers",
    ),
    "flows": ("cli", ""),
}
HALL_GROUPS = {
    "storage": {
        "base": {
            "store",
            "tables",
            "readers",
            "location",
            "object_lock",
            "toml_lines",
            "jit",
            "exit_gate",
        }
    },
    "tasks": {"chunking": {"chunk", "chunk_content", "chunk_section", "place"}},
}
MAX_MODULES = 20  # .py files in one folder or room, __init__.py included
MAX_LINES = 700
MAX_FUNCTION_LINES = 80  # a function longer than this is a long one
MAX_PARAMETERS = 8  # besides self/cls
PACKAGE = "coinrag"  # the one installed name: the folders are coinrag.<folder>
# (file, imported module) of the imports that still run against the layers.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# Files over MAX_LINES lines.
KNOWN_LONG: set[str] = set()
# The functions still over the limits (file:function). Exact lists: they only shrink.
KNOWN_LONG_FUNCTIONS = {
    "tasks/extractors/openai_batch.py:_collect",
    "tasks/extractors/openai_chat.py:_extract_one",
}
KNOWN_WIDE_FUNCTIONS = {
    "inference/evaluation/evaluate.py:evaluate",
    "inference/methods/engine.py:__init__",
    "flows/cli/api.py:api",
    "tasks/chunk.py:chunk_document",
    "inference/evaluation/retrieval_only.py:evaluate_retrieval",
}


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


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{p.relative_to(REPO).as_posix()}:{node.name}", node))
    return out


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return len([n for n in names if n not in ("self", "cls")])


def test_functions_are_short_and_narrow() -> None:
    """At most MAX_FUNCTION_LINES lines and MAX_PARAMETERS parameters, except the listed ones
    (at most five of each, exact)."""
    long = {
        name
        for name, node in _functions()
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    wide = {name for name, node in _functions() if _parameters(node) > MAX_PARAMETERS}
    assert long == KNOWN_LONG_FUNCTIONS, (
        f"new long: {long - KNOWN_LONG_FUNCTIONS}, fixed: {KNOWN_LONG_FUNCTIONS - long}"
    )
    assert wide == KNOWN_WIDE_FUNCTIONS, (
        f"new wide: {wide - KNOWN_WIDE_FUNCTIONS}, fixed: {KNOWN_WIDE_FUNCTIONS - wide}"
    )
    assert len(KNOWN_LONG_FUNCTIONS) <= 5 and len(KNOWN_WIDE_FUNCTIONS) <= 5


def test_tests_mirror_the_folders() -> None:
    """Tests live in ``tests/<folder>/`` after the product folder they test (the real files
    they read in ``tests/fixtures/``); only the checks of the whole tree (this file, the
    README's) stay at the top."""
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir()}
    assert folders - {"benchmarks", "fixtures", "__pycache__"} <= set(RANK)
    top = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert top == {"test_layout.py", "test_readme.py"}


def _level(path_or_module: str) -> tuple[str, str] | None:
    """(folder, level) of a repository path (``inference/model/encode.py``) or a project
    module (``coinrag.inference.model.encode``); None outside the ranked folders."""
    parts = path_or_module.removesuffix(".py").replace("/", ".").split(".")
    if parts[0] == PACKAGE:
        parts = parts[1:]
    if not parts or parts[0] not in RANK:
        return None
    folder, rest = parts[0], parts[1:]
    if rest and rest[0] in LEVELS.get(folder, ()) and (REPO / folder / rest[0]).is_dir():
        return folder, rest[0]
    name = rest[0] if rest else ""
    group = next((g for g, names in HALL_GROUPS.get(folder, {}).items() if name in names), "")
    return folder, group


def test_levels_inside_folders_import_down_only() -> None:
    """Inside a folder, a module imports its own level and the levels below it only."""
    bad = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        src = _level(rel)
        if src is None or path.name == "__init__.py" and src[1] == "":
            continue
        folder, level = src
        levels = LEVELS.get(folder, ("",))
        for line, imported in _imports(path):
            dst = _level(imported)
            if dst is None or dst[0] != folder or dst[1] == level:
                continue
            if levels.index(dst[1]) < levels.index(level):
                bad.append(f"{rel}:{line} {level or 'hall'} imports {dst[1] or 'hall'} above it")
    assert not bad, "imports against the levels:\n" + "\n".join(bad)


def test_rooms_are_listed_and_small() -> None:
    """Every subfolder of a ranked folder is one of its ``LEVELS`` (and every listed room
    exists); no folder or room holds more than ``MAX_MODULES`` modules."""
    for folder in RANK:
        rooms = {p.name for p in (REPO / folder).iterdir() if (p / "__init__.py").exists()}
        groups = set(HALL_GROUPS.get(folder, {}))
        assert rooms == set(LEVELS.get(folder, ())) - groups - {""}, (folder, rooms)
    crowded = {
        d.relative_to(REPO).as_posix(): n
        for folder in RANK
        for d in [REPO / folder, *(p for p in (REPO / folder).iterdir() if p.is_dir())]
        if (n := len(list(d.glob("*.py")))) > MAX_MODULES
    }
    assert not crowded, f"over {MAX_MODULES} modules: {crowded}"
