"""The README's CLI synopsis is `coinrag --help` (and `coinrag train --help`) as the CLI prints it
at a fixed terminal width, so the command list in the guide cannot drift from the code. On a
mismatch the failure prints the block to paste into README.md between the markers. The guide's
links (README.md, docs/, RESULTS.md) must stay inside the repository and resolve."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

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


PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]
RESULTS = README.parent / "tests" / "benchmarks" / "RESULTS.md"
WEB = ("http://", "https://")  # web links name no file of the checkout: not checked
_FENCED = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", flags=re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", flags=re.MULTILINE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_links(text: str) -> list[str]:
    """Targets of the inline links, images and link definitions of a Markdown text, outside
    code blocks and code spans."""
    prose = _CODE_SPAN.sub("", _FENCED.sub("", text))
    return _INLINE_LINK.findall(prose) + _LINK_DEFINITION.findall(prose)


def link_problem(page: Path, target: str) -> str | None:
    """Why the link ``target`` of ``page`` is broken, or None: it must name a file of this
    repository that exists (relative to the page), and its #anchor a heading there."""
    root = README.parent.resolve()
    if target.startswith(WEB):
        return None
    if _SCHEME.match(target) or target.startswith("/"):
        return "points outside the repository"
    path, _, anchor = target.partition("#")
    file = (page.parent / unquote(path)).resolve() if path else page.resolve()
    if not file.is_relative_to(root):
        return "points outside the repository"
    if not file.exists():
        return "names a file that does not exist"
    if anchor and file.suffix == ".md" and anchor not in _anchors(file):
        return f"names no heading #{anchor} of {file.relative_to(root)}"
    return None


def linked_pages() -> list[Path]:
    """README.md, docs/*.md, and tests/benchmarks/RESULTS.md when one of them links to it."""
    linked = any(
        (page.parent / t.partition("#")[0]).resolve() == RESULTS.resolve()
        for page in PAGES
        for t in markdown_links(page.read_text(encoding="utf-8"))
        if t.partition("#")[0]
    )
    return [*PAGES, RESULTS] if linked else list(PAGES)


def test_readme_links_resolve() -> None:
    """Every Markdown link of README.md, docs/*.md and tests/benchmarks/RESULTS.md (linked from
    them) names a file of this repository that exists, and its #anchor a heading there. A link
    that leaves the repository (``../shared/...``, an absolute path, ``file:``) fails: whoever
    clones the project has none of it. Web links (http, https) are not checked."""
    root = README.parent
    broken = []
    for page in linked_pages():
        for target in markdown_links(page.read_text(encoding="utf-8")):
            problem = link_problem(page, target)
            if problem:
                broken.append(f"{page.relative_to(root)} -> {target}: {problem}")
    assert not broken, "\n".join(broken)


def test_pages_name_no_path_outside_the_repository() -> None:
    """A path written in prose or a code span (`../shared/REFERENCE.md`) is a link too for a
    reader: none may lead out of the repository (code blocks are left alone: commands)."""
    root = README.parent.resolve()
    out = []
    for page in linked_pages():
        prose = _FENCED.sub("", page.read_text(encoding="utf-8"))
        for path in re.findall(r"(?<![\w/.])\.\./[\w./-]*", prose):
            if not (page.parent / path).resolve().is_relative_to(root):
                out.append(f"{page.relative_to(root)}: {path}")
    assert not out, f"paths outside the repository (link docs/background.md instead): {out}"


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("docs/cli.md", None),
        ("docs/cli.md#the-commands", "names no heading #the-commands of docs/cli.md"),
        ("#the-commands", None),
        ("https://arxiv.org/abs/2405.16444", None),
        ("../shared/REFERENCE.md", "points outside the repository"),
        ("../shared/papers/", "points outside the repository"),
        ("/work/shared/DESIGN.md", "points outside the repository"),
        ("file:///etc/hosts", "points outside the repository"),
        ("docs/nowhere.md", "names a file that does not exist"),
    ],
)
def test_link_problem_examples(target: str, problem: str | None) -> None:
    """The check itself, on README.md: each kind of broken link is caught."""
    assert link_problem(README, target) == problem


def test_markdown_links_skip_code() -> None:
    text = '[a](x.md) `[b](y.md)` ![c](z.png)\n```\n[d](w.md)\n```\n[e]: v.md "t"\n'
    assert markdown_links(text) == ["x.md", "z.png", "v.md"]


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
