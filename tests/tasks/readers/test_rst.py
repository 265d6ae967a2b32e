"""The reST reader: section titles and their levels, against Sphinx's own rendering of the same
sources (the FAQ pages in tests/fixtures/html/: each ``.rst.txt`` beside the ``.html`` Sphinx
built from it) and on small texts written here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coinrag.tasks.ingest import ingest
from coinrag.tasks.readers.base import Reader, ReadError
from coinrag.tasks.readers.rst import clean_title, rst_headings

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "html"
# Sphinx's typography (smartquotes) against the reST source's ASCII.
TYPOGRAPHY = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "…": "...", "–": "--"})


def words(title: str) -> str:
    return " ".join(re.findall(r"\w+", title.translate(TYPOGRAPHY).lower()))


def read_rst(text: str):
    return Reader.registry["rst"]().read(text.encode(), "doc.rst")


@pytest.mark.parametrize("page", ["general", "programming"])
def test_titles_and_levels_are_the_ones_sphinx_rendered(page: str) -> None:
    """The oracle is Sphinx's HTML of the same source: its section headings, in order, with
    their levels (h1 = 1, ...), as the HTML reader reads them from the page's main content."""
    rst = read_rst((FIXTURES / f"{page}.rst.txt").read_text(encoding="utf-8"))
    html = Reader.registry["html"](html_mode="main").read(
        (FIXTURES / f"{page}.html").read_bytes(), f"{page}.html"
    )
    assert len(rst.headings) > 20
    assert [(h.level, words(h.title)) for h in rst.headings] == [
        (h.level, words(h.title)) for h in html.headings
    ]
    assert rst.title == html.title


def test_heading_offsets_start_at_the_overline_or_the_title_line() -> None:
    text = "=====\nGuide\n=====\n\nIntro\n-----\n\nSetup\n-----\n"
    doc = read_rst(text)
    assert [(h.char_start, h.level, h.title) for h in doc.headings] == [
        (0, 1, "Guide"),
        (19, 2, "Intro"),
        (32, 2, "Setup"),
    ]
    assert doc.title == "Guide"
    assert doc.text == text  # the text is untouched
    assert doc.section_at(text.index("Setup") + 8) == ("Guide", "Setup")


def test_levels_follow_the_order_styles_first_appear() -> None:
    """A style is the character and whether it is overlined: ``=`` over and under, ``=``
    under and ``-`` under are three levels, numbered as they first appear."""
    text = (
        "Top\n***\n\nA\n==\n\nA.1\n---\n\n"
        "=====\nOver\n=====\n\nB\n==\n\nB.1\n---\n\n  Inset\n-------\n"
    )
    got = [(h.level, h.title) for h in rst_headings(text)]
    assert got == [(1, "Top"), (2, "A"), (3, "A.1"), (4, "Over"), (2, "B"), (3, "B.1")]
    inset = "-------\n  Inset\n-------\n\nText.\n"
    assert [(h.char_start, h.title) for h in rst_headings(inset)] == [(0, "Inset")]


@pytest.mark.parametrize(
    "text",
    [
        "A paragraph\nthat goes on\n------------\n",  # the line under a paragraph's last line
        "\n   Indented\n   --------\n",  # an underlined title starts at the margin
        "Text.\n\n----------\n\nMore text.\n",  # a transition
        "Too long a title\n-----\n",  # an underline shorter than the title
        "=====  =====\nA      B\n=====  =====\n",  # a simple table's borders
        "Example::\n\n    Code\n    ====\n\n",  # inside a literal block
        "x\n-\n",  # a one-character adornment
    ],
)
def test_what_is_not_a_title(text: str) -> None:
    assert rst_headings(text) == ()


def test_a_title_after_a_literal_block_ends() -> None:
    text = "Example::\n\n    Code\n    ====\n\nAfter\n=====\n\nText.\n"
    assert [h.title for h in rst_headings(text)] == ["After"]


def test_clean_title_drops_inline_markup() -> None:
    assert clean_title(":mod:`re` --- Regular expressions") == "re --- Regular expressions"
    assert clean_title("The ``with`` *statement*") == "The with statement"
    assert clean_title("See `the docs <https://x.org>`_ and `Other`_") == "See the docs and Other"
    assert clean_title(":func:`~os.path.join` |version|") == "os.path.join version"
    assert clean_title("New :ref:`dict <typesmapping>` implementation") == "New dict implementation"


def test_a_folder_of_rst_files_builds_documents_with_their_sections(tmp_path: Path) -> None:
    (tmp_path / "faq").mkdir()
    data = (FIXTURES / "programming.rst.txt").read_bytes()
    (tmp_path / "faq" / "programming.rst").write_bytes(data)
    (doc,) = ingest(tmp_path).documents
    assert doc.doc_id == "faq/programming"
    origin = doc.origin
    assert origin is not None
    assert (origin.format, origin.title) == ("rst", "Programming FAQ")
    assert "How do you make an array in Python?" in origin.heading_titles


def test_invalid_utf8_is_a_reject_reason() -> None:
    with pytest.raises(ReadError) as err:
        Reader.registry["rst"]().read(b"Title\n=====\n\xff", "bad.rst")
    assert err.value.reason == "invalid_utf8"
