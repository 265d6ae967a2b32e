"""The PDF reader (``tasks/readers/pdf.py``) on real PDFs: Debian's Python FAQ pages printed by
headless Chromium with its default header and footer, a serif page with hyphenation, pages that
end in a hyphen, page labels, a scan, encrypted, truncated and page-less files
(``infra/make_pdf_fixtures.sh`` makes them)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pypdfium2 as pdfium
import pytest

from coinrag.tasks.readers.base import ReadDocument, Reader, ReadError
from coinrag.tasks.readers.pdf import (
    PAGE_SEPARATOR,
    PdfReader,
    TextLine,
    hyphen_kept,
    reading_order,
    rejoin_hyphens,
    running_lines,
    vocabulary,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "pdf"
# Headless Chromium's default header (date, time, title) and footer (URL, "n/N"), as PDFium
# writes them when they come out as one line each.
HEADER = re.compile(r"\d{1,2}/\d{1,2}/\d{2}, \d{1,2}:\d{2} [AP]M .+")
FOOTER = re.compile(r"file://\S+ \d+/\d+")
SENTENCE = (
    "Every worked example of hyphenation shows a well-known object-oriented language with "
    "built-in types."
)


def read(name: str) -> ReadDocument:
    return PdfReader().read((FIXTURES / name).read_bytes(), name)


def page_texts(doc: ReadDocument) -> list[str]:
    """Each page's text as the page map cuts the document's text."""
    ends = [p.char_start - len(PAGE_SEPARATOR) for p in doc.pages[1:]] + [len(doc.text)]
    return [doc.text[p.char_start : end] for p, end in zip(doc.pages, ends, strict=True)]


def pdfium_lines(name: str) -> list[list[str]]:
    """Each page's lines as pypdfium2's own text page gives them."""
    pdf = pdfium.PdfDocument((FIXTURES / name).read_bytes())
    try:
        return [pdf[i].get_textpage().get_text_range().split("\r\n") for i in range(len(pdf))]
    finally:
        pdf.close()


@pytest.mark.parametrize("name", ["general.pdf", "design.pdf"])
def test_each_page_is_its_text_page_without_the_running_lines(name: str) -> None:
    doc = read(name)
    raw = pdfium_lines(name)
    assert [(p.number, p.label) for p in doc.pages] == [(i, str(i)) for i in range(1, len(raw) + 1)]
    assert doc.pages[0].char_start == 0
    for number, (lines, text) in enumerate(zip(raw, page_texts(doc), strict=True), start=1):
        running = [line for line in lines if HEADER.fullmatch(line) or FOOTER.fullmatch(line)]
        assert len(running) == 2, (number, running)  # the test's own header and footer finder
        assert running[1].endswith(f" {number}/{len(raw)}")
        # The same lines (reordered where PDFium's order was not the reading order); PDFium's
        # "up-and\ufffecoming" (its own join of a line-end hyphen) comes out as "up-and-coming".
        body = [line.strip().replace("\ufffe", "-") for line in lines if line not in running]
        assert Counter(text.split("\n")) == Counter(line for line in body if line), number
    for line in doc.text.split("\n"):
        assert not (HEADER.fullmatch(line) or FOOTER.fullmatch(line)), line
        assert not re.fullmatch(r"\d+/\d+", line.strip()), line
    assert "file://" not in doc.text and not re.search(r"\d+/\d+/\d+, \d+:\d+ [AP]M", doc.text)
    assert doc.title is not None and doc.title not in doc.text  # the header's title line


def test_known_questions_and_the_outline() -> None:
    doc = read("general.pdf")
    assert doc.title == "General Python FAQ — Python 3.11.2 documentation"
    for question in ("What is Python?", "Why is it called Python?", "How stable is Python?"):
        assert question in doc.text
    titles = [h.title for h in doc.headings]
    assert titles[:3] == ["General Python FAQ", "General Information", "What is Python?"]
    assert len(titles) == 26 and [h.level for h in doc.headings[:3]] == [1, 2, 3]
    for h in doc.headings:
        assert " ".join(doc.text[h.char_start :].split()).startswith(h.title)
    info = doc.headings[1]
    assert doc.text.index("General Information") < info.char_start  # the Contents list's first
    psf = doc.text.index("The Python Software Foundation is an independent")
    assert doc.section_at(psf) == (
        "General Python FAQ",
        "General Information",
        "What is the Python Software Foundation?",
    )
    assert [p.number for p in doc.page_span(psf, psf + 10)] == [2]
    design = read("design.pdf")
    assert "Why does Python use indentation for grouping of statements?" in [
        h.title for h in design.headings
    ]


def test_reading_order_puts_a_code_block_where_it_is_on_the_page() -> None:
    # Chromium draws the code block that runs on from page 6 after the paragraphs of page 7.
    raw = "\n".join(pdfium_lines("general.pdf")[6])
    assert raw.index("With the interpreter") < raw.index("['__add__'")
    last = page_texts(read("general.pdf"))[6]
    assert last.index("['__add__'") < last.index(">>> L.append(1)") < last.index("With the interp")


def test_page_labels_and_an_outline_of_goto_actions() -> None:
    doc = read("labels.pdf")
    assert [(p.number, p.label) for p in doc.pages] == [(1, "i"), (2, "ii"), (3, "1"), (4, "A-7")]
    assert "file://" not in doc.text and "What is Python?" in doc.text
    whole = read("general.pdf")
    assert doc.text == whole.text[: whole.pages[4].char_start - len(PAGE_SEPARATOR)]
    assert list(doc.headings) == [h for h in whole.headings if h.char_start < len(doc.text)]
    assert len(doc.headings) == 15


def one_or_two_pages(n: int) -> bytes:
    """The first ``n`` pages of general.pdf as a new PDF (no metadata: no title)."""
    src = pdfium.PdfDocument((FIXTURES / "general.pdf").read_bytes())
    out = pdfium.PdfDocument.new()
    out.import_pages(src, list(range(n)))
    buf = io.BytesIO()
    out.save(buf)
    return buf.getvalue()


def test_a_one_page_chromium_pdf_loses_its_header_and_footer_by_their_own_marks() -> None:
    """Nothing repeats on one page: the footer ends in the page's own counter "1/1" and the
    header holds the PDF's title and a date (tasks/readers/pdf.py: marks_itself)."""
    data = (FIXTURES / "bool.pdf").read_bytes()
    doc = PdfReader().read(data, "bool.pdf")
    raw = pdfium.PdfDocument(data)[0].get_textpage().get_text_range()
    assert len(doc.pages) == 1 and doc.title and doc.title in raw and "1/1" in raw
    assert "file://" not in doc.text and "1/1" not in doc.text
    assert doc.title not in doc.text and not HEADER.search(doc.text)
    assert doc.text.lstrip("Go\n").startswith("Boolean Objects")


def test_one_page_keeps_its_header_two_pages_lose_it() -> None:
    """A page cut out of a longer PDF (its counter says 1/7, it has no title): nothing marks
    its header or footer, and nothing repeats."""
    one = PdfReader().read(one_or_two_pages(1), "one.pdf")
    assert one.title is None
    assert "file:///usr/share/doc/python3.11/html/faq/general.html 1/7" in one.text
    two = PdfReader().read(one_or_two_pages(2), "two.pdf")
    assert "file://" not in two.text and len(two.pages) == 2


def test_a_blank_page_is_an_empty_page_of_the_map() -> None:
    src = pdfium.PdfDocument((FIXTURES / "general.pdf").read_bytes())
    pdf = pdfium.PdfDocument.new()
    pdf.import_pages(src, [0])
    pdf.new_page(612, 792)
    pdf.import_pages(src, [1])
    buf = io.BytesIO()
    pdf.save(buf)
    doc = PdfReader().read(buf.getvalue(), "blank.pdf")
    assert doc.extra == {"pages_without_text": [2]}
    first, blank, third = page_texts(doc)
    assert blank == "" and third.split("\n")[1] == "What is the Python Software Foundation?"
    # The header is on 2 pages of 3, under the 3 a running line needs: it stays, at the top.
    assert HEADER.fullmatch(first.split("\n")[0]) and HEADER.fullmatch(third.split("\n")[0])


def test_hyphenation_in_a_chromium_pdf() -> None:
    raw = "\n".join("\n".join(lines) for lines in pdfium_lines("hyphens.pdf"))
    # PDFium joins "well-\nknown" itself (U+FFFE for the hyphen); Chromium draws a soft hyphen
    # as U+2010 at the line end.
    assert "well\ufffeknown" in raw and "built\ufffein" in raw and "object\ufffeoriented" in raw
    assert re.search("exam(\u2010\n|\n\u2010\n)ple", raw)
    doc = read("hyphens.pdf")
    assert not set("\ufffe\u2010\u00ad") & set(doc.text)
    flat = " ".join(doc.text.split())
    assert flat.count(SENTENCE) == 20  # every paragraph, whatever its width
    for wrong in ("wellknown", "builtin", "objectoriented", "exam-ple", "hyphen-ation"):
        assert wrong not in flat
    assert "file://" not in doc.text and "Hyphenation sample" not in doc.text


def test_a_page_ending_in_a_hyphen_keeps_the_next_header_apart() -> None:
    """PDFium joins a page's last line, when it ends in a hyphen, to the next text drawn, here
    page 2's header (seen on the Python docs' ``library/urllib.request`` printed by Chromium,
    p. 19): the joined text is cut again where it leaves the row, so the header goes as on every
    other page and the word stays whole (``x-www-`` at the page end)."""
    raw = ["\n".join(lines) for lines in pdfium_lines("pageend.pdf")]
    joined = [i for i, text in enumerate(raw) if re.search("\ufffe\\d+/\\d+/\\d+, ", text)]
    assert joined  # the fixture still has a page whose last line PDFium joined to a header
    doc = read("pageend.pdf")
    assert "file://" not in doc.text and not re.search(r"\d+/\d+/\d+, \d+:\d+", doc.text)
    assert "Page-end hyphens" not in doc.text and "\ufffe" not in doc.text
    texts = page_texts(doc)
    for i in joined:
        assert texts[i].endswith("-") and texts[i + 1][0].islower(), texts[i][-40:]
    words = set(doc.text.split())
    compounds = {"well-known", "object-oriented", "built-in", "read-only", "run-time"}
    assert compounds | {"x-www-form-urlencoded", "non-blocking"} <= words


def test_hyphen_rule() -> None:
    words = vocabulary(["an example", "a built-in", "the builtin module", "a built-in"])
    assert hyphen_kept("exam", "ple", "-", words) == ""  # the joined word is known
    assert hyphen_kept("built", "in", "-", words) == "-"  # the compound is more frequent
    assert hyphen_kept("built", "in", "\ufffe", words) == "-"
    assert hyphen_kept("well", "known", "-", words) == "-"  # unknown: a typed hyphen stays
    assert hyphen_kept("well", "known", "\ufffe", words) == "-"
    assert hyphen_kept("typo", "graphy", "\u2010", words) == ""  # unknown: a typesetter's goes
    assert hyphen_kept("built", "in", "\u2010", words) == "\u2010"
    assert hyphen_kept("any", "thing", "\u00ad", words) == ""  # a soft hyphen always goes
    lines = [
        TextLine(t, 0, 0, 1, 1)
        for t in ("an exam-", "ple of a built-", "in, Jean-", "Paul and x -", "y", "co\u00adop")
    ]
    assert [line.text for line in rejoin_hyphens(lines, words)] == [
        "an example of a built-in, Jean-",
        "Paul and x -",
        "y",
        "coop",
    ]


def band_page(*texts: str) -> list[TextLine]:
    """A 100-point-high page: ``texts[0]`` at its top, ``texts[-1]`` at its bottom, body between."""
    ys = [95 - 90 * i / max(len(texts) - 1, 1) for i in range(len(texts))]
    return [TextLine(t, 10, y - 2, 90, y + 2) for t, y in zip(texts, ys, strict=True)]


def test_running_lines_need_to_come_back() -> None:
    boxes = [(0.0, 100.0)] * 7
    pages = [band_page(f"Report {n}", "body", f"- {n} -") for n in range(1, 8)]
    assert running_lines(pages, boxes) == [{0, 2}] * 7  # the digits do not count
    for times, dropped in ((2, set()), (3, {0})):
        # Body text at the top of ``times`` pages of seven, other tops all different.
        tops = ["Same words" if n < times else f"Top {chr(97 + n)}" for n in range(7)]
        pages = [band_page(top, "body", f"end {chr(97 + n)}") for n, top in enumerate(tops)]
        assert running_lines(pages, boxes) == [dropped] * times + [set()] * (7 - times)
    assert running_lines([band_page("Title", "body", "1")], boxes[:1]) == [set()]
    two = [band_page("Title", "one", "1"), band_page("Title", "two", "2")]
    assert running_lines(two, boxes[:2]) == [{0, 2}, {0, 2}]


def test_reading_order_cuts_columns_before_rows() -> None:
    left = [TextLine(f"L{i}", 10, 90 - 10 * i, 45, 96 - 10 * i) for i in range(5)]
    right = [TextLine(f"R{i}", 55, 90 - 10 * i, 90, 96 - 10 * i) for i in range(5)]
    title = TextLine("Title", 10, 100, 90, 108)
    mixed = [right[0], left[0], title, *right[1:], *left[1:]]  # drawn in any order
    assert [line.text for line in reading_order(mixed)] == [
        "Title",
        *(f"L{i}" for i in range(5)),
        *(f"R{i}" for i in range(5)),
    ]
    narrow = [TextLine(t.text, 48, t.y0, t.x1, t.y1) for t in right]
    # A 3-point gutter, narrower than the 4 points between the rows.
    assert [line.text for line in reading_order([*narrow, *left])] == [
        *(f"L{i}" for i in range(5)),
        *(f"R{i}" for i in range(5)),
    ]
    joined = reading_order([TextLine("exam", 10, 0, 40, 10), TextLine("\u2010", 40.5, 0, 44, 10)])
    assert [line.text for line in joined] == ["exam\u2010"]


@pytest.mark.parametrize(
    ("name", "reason", "words"),
    [
        ("scanned.pdf", "no_text_layer", "no text layer (scanned?)"),
        ("encrypted.pdf", "encrypted", "password"),
        ("empty.pdf", "empty", "no pages"),
    ],
)
def test_rejects(name: str, reason: str, words: str) -> None:
    with pytest.raises(ReadError) as caught:
        read(name)
    assert caught.value.reason == reason
    assert caught.value.detail.startswith(f"{name}: ") and words in caught.value.detail


def test_corrupt_files() -> None:
    data = (FIXTURES / "general.pdf").read_bytes()
    for broken in (data[: len(data) // 2], b"", b"%PDF-1.7\n%%EOF\n"):
        with pytest.raises(ReadError) as caught:
            PdfReader().read(broken, "cut.pdf")
        assert caught.value.reason == "corrupt" and "cut.pdf" in caught.value.detail
    # A page tree that promises 3 pages and has none: it opens, its pages do not.
    body = b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 3 >>"
    pdf, offsets = b"%PDF-1.4\n", []
    for i, obj in enumerate(body, start=1):
        offsets.append(len(pdf))
        pdf += b"%d 0 obj\n%s\nendobj\n" % (i, obj)
    xref = len(pdf)
    pdf += b"xref\n0 3\n0000000000 65535 f \n" + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    pdf += b"trailer << /Root 1 0 R /Size 3 >>\nstartxref\n%d\n%%%%EOF\n" % xref
    with pytest.raises(ReadError) as caught:
        PdfReader().read(pdf, "lies.pdf")
    assert caught.value.reason == "corrupt" and "page 1 of 3" in caught.value.detail


def test_owner_password_only_is_read() -> None:
    assert read("owner_only.pdf").text == read("hyphens.pdf").text


def test_deterministic_registered_and_cheap_to_import() -> None:
    assert read("design.pdf") == read("design.pdf")
    assert Reader.registry["pdf"] is PdfReader and ".pdf" in PdfReader.suffixes
    probe = "import sys, coinrag.tasks.readers.pdf; print('pypdfium2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
