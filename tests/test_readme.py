"""The README's CLI synopsis is `coinrag --help` (and `coinrag train --help`) as the CLI prints it
at a fixed terminal width, so the command list in the guide cannot drift from the code. On a
mismatch the failure prints the block to paste into README.md between the markers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coinrag.flows.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"
WIDTH = "100"  # columns the README's blocks are rendered at
MARKER = "<!-- synopsis: coinrag {args} (COLUMNS=100; tests/test_readme.py) -->"


def _normalise(text: str) -> str:
    """Trailing spaces and the blank lines around the block dropped (rich pads to the width)."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def readme_block(args: str) -> str:
    """The fenced block that follows ``MARKER`` for ``args`` in README.md, normalised."""
    marker = MARKER.format(args=args)
    text = README.read_text(encoding="utf-8")
    assert marker in text, f"README.md lacks the marker line {marker!r} before its synopsis block"
    found = re.search(re.escape(marker) + r"\n```text\n(.*?)\n```", text, flags=re.DOTALL)
    assert found, f"README.md: no ```text block right after {marker!r}"
    return _normalise(found.group(1))


def help_output(args: str) -> str:
    """``coinrag ARGS`` on a terminal ``WIDTH`` columns wide (no colour: not a TTY), normalised."""
    result = CliRunner().invoke(
        app, args.split(), env={"COLUMNS": WIDTH, "NO_COLOR": "1"}, prog_name="coinrag"
    )
    assert result.exit_code == 0, result.output
    return _normalise(result.output)


@pytest.mark.parametrize("args", ["--help", "train --help"])
def test_readme_synopsis_is_the_cli_help(args: str) -> None:
    expected = help_output(args)
    got = readme_block(args)
    if got != expected:
        marker = MARKER.format(args=args)
        pytest.fail(
            f"README.md's synopsis of `coinrag {args}` differs from the CLI's help. "
            f"Replace the block after {marker!r} with:\n\n```text\n{expected}\n```\n",
            pytrace=False,
        )


def test_readme_keeps_the_two_commands() -> None:
    """.ci/run and tests/flows/test_sample_showcase.py rely on these two commands being the
    README's."""
    text = README.read_text(encoding="utf-8")
    assert "bash infra/run_sample.sh" in text
    assert "bash infra/test.sh" in text
    for script in ("infra/run_sample.sh", "infra/test.sh"):
        assert (README.parent / script).is_file(), script


def test_readme_links_resolve() -> None:
    """Every relative link of README.md, docs/*.md and tests/benchmarks/RESULTS.md names a file
    that exists, and its #anchor a heading there (the reference moved out of the README; a link
    must not dangle)."""
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md")), root / "tests/benchmarks/RESULTS.md"]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            if not path or "://" in path:
                continue
            file = page.parent / path
            if not file.exists() or (anchor and anchor not in _anchors(file)):
                missing.append(f"{page.relative_to(root)} -> {target}")
    assert not missing, missing


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page: lower case, punctuation but
    ``-`` and ``_`` dropped, spaces as ``-``."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_code_paths_exist() -> None:
    """Every file or folder of the product the README names in backticks (``tasks/chunk.py``,
    ``storage/kv/``, ``flows/cli``: a module or a package) exists: "where each concept lives"
    must not point at code that moved."""
    root = README.parent
    folders = "flows|tasks|training|inference|storage|schemas|infra|tests|docs"
    spans = re.findall(rf"`((?:{folders})/[\w./]*)`", README.read_text(encoding="utf-8"))
    missing = sorted(
        {s for s in spans if not (root / s).exists() and not (root / f"{s}.py").exists()}
    )
    assert not missing, f"README.md names paths that do not exist: {missing}"
