"""Headings of a PDF without an outline, by font size (``tasks/readers/pdf_headings.py``): held
to the outline Chromium wrote for the same pages (its entries are the HTML's h1-h6), and the
rules on lines made up for them."""

from __future__ import annotations

import io
from pathlib import Path

import pypdfium2 as pdfium
import pytest

from coinrag.tasks.readers.base import Heading
from coinrag.tasks.readers.pdf import PdfReader
from coinrag.tasks.readers.pdf_headings import (
    SizedLine,
    body_size,
    font_headings,
    line_size,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "pdf"


def without_outline(name: str, pages: list[int] | None = None) -> bytes:
    """The fixture's pages (all by default) copied into a new PDF: no outline, no metadata."""
    src = pdfium.PdfDocument((FIXTURES / name).read_bytes())
    out = pdfium.PdfDocument.new()
    out.import_pages(src, pages if pages is not None else list(range(len(src))))
    buf = io.BytesIO()
    out.save(buf)
    assert not list(pdfium.PdfDocument(buf.getvalue()).get_toc())
    return buf.getvalue()


@pytest.mark.parametrize("name", ["general.pdf", "labels.pdf"])
def test_font_sizes_find_the_headings_the_outline_names(name: str) -> None:
    """The same pages without their outline: every heading of the outline, at the same offset,
    level and title, and no other."""
    with_outline = PdfReader().read((FIXTURES / name).read_bytes(), name)
    without = PdfReader().read(without_outline(name), name)
    shift = len(without.text) - len(with_outline.text)
    expected = [Heading(h.char_start + shift, h.level, h.title) for h in with_outline.headings]
    assert list(without.headings) == expected and len(expected) >= 15


def test_font_sizes_also_find_headings_the_outline_could_not_place() -> None:
    """design.pdf: two long titles wrap over two lines, where the outline's entries are not
    found on their page by the outline reader; by size they are whole headings."""
    data = (FIXTURES / "design.pdf").read_bytes()
    with_outline = PdfReader().read(data, "design.pdf")
    without = PdfReader().read(without_outline("design.pdf"), "design.pdf")
    shift = len(without.text) - len(with_outline.text)
    placed = {(h.char_start + shift, h.level, h.title) for h in with_outline.headings}
    found = {(h.char_start, h.level, h.title) for h in without.headings}
    assert placed < found
    extra = {title for _, _, title in found - placed}
    threads = (
        "Can’t you emulate threads in the interpreter instead of relying on an OS-specific "
        "thread implementation?"
    )
    assert threads in extra and len(extra) == 2
    for h in without.headings:
        assert " ".join(without.text[h.char_start :].split()).startswith(h.title)


def test_a_chromium_page_without_an_outline_has_sections() -> None:
    doc = PdfReader().read(without_outline("general.pdf", [1]), "p2.pdf")
    psf = doc.text.index("The Python Software Foundation is an independent")
    # The page starts inside "General Information" (on page 1): the path starts lower.
    assert doc.section_at(psf)[-1] == "What is the Python Software Foundation?"


def test_the_pdfs_without_headings_have_none() -> None:
    for name in ("hyphens.pdf", "pageend.pdf"):  # one size of type on every line of body text
        assert PdfReader().read((FIXTURES / name).read_bytes(), name).headings == ()


def line(offset: int, text: str, size: float, top: float, page: int = 0) -> SizedLine:
    return SizedLine(offset, text, size, page, top, top - size)


def test_line_and_body_sizes() -> None:
    assert line_size([14.0, 14.02, 13.5, 1.0, 1.0, 1.0]) == 14.0  # made-up characters report 1
    assert line_size([16.0, 12.0]) == 16.0 and line_size([]) == 0.0
    lines = [
        line(0, "Title", 24, 700),
        line(6, "body " * 20, 12, 670),
        line(107, "x" * 50, 10, 650),
    ]
    assert body_size(lines) == 12 and body_size([]) == 0.0


def test_levels_wrapped_titles_and_what_is_not_a_heading() -> None:
    lines = [
        line(0, "A Guide", 24, 760),
        line(8, "Setting up a new machine", 18, 720),
        line(33, "from scratch", 18.2, 700),  # the same heading, wrapped (within 0.5 pt)
        line(46, "Body text " * 10, 12, 670),
        line(147, "Body text " * 10, 12, 655),
        line(248, "Installing", 16, 620),
        line(259, "2024", 16, 600),  # no letter
        line(264, "Body text " * 30, 16, 580),  # too long for a heading
        line(565, "Body text " * 40, 12, 560),
        line(966, "Next steps", 18, 750, page=1),
        line(977, "on page two", 18, 650, page=1),  # far below: a heading of its own
        line(989, "Small print", 12.9, 640, page=1),  # 1.075 x body: not a heading
    ]
    assert font_headings(lines) == (
        Heading(0, 1, "A Guide"),
        Heading(8, 2, "Setting up a new machine from scratch"),
        Heading(248, 3, "Installing"),
        Heading(966, 2, "Next steps"),
        Heading(977, 2, "on page two"),
    )
    assert font_headings([line(0, "one size", 12, 700), line(9, "all over", 12, 680)]) == ()
    # Two headings in a row, a heading's margin (0.57 of a line) apart: not one wrapped title.
    two = [line(0, "9.18. distutils.log", 16, 700), line(20, "9.19. distutils.spawn", 16, 675)]
    assert [h.title for h in font_headings([*two, line(42, "x " * 99, 12, 640)])] == [
        "9.18. distutils.log",
        "9.19. distutils.spawn",
    ]
    assert font_headings([]) == ()
