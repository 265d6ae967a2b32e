"""The Word reader on .docx files written here with python-docx: headings, lists (by style and
by numbering properties), tables, the title, and the errors."""

from __future__ import annotations

import io
import zipfile

import docx
import pytest
from docx.oxml import parse_xml
from docx.oxml.ns import nsdecls

from coinrag.tasks.readers.base import ReadDocument, Reader, ReadError


def read(document: docx.document.Document, name: str = "doc.docx") -> ReadDocument:
    buf = io.BytesIO()
    document.save(buf)
    return Reader.registry["docx"]().read(buf.getvalue(), name)


def guide() -> docx.document.Document:
    """A title, two heading levels, paragraphs, bullet and numbered lists, two tables."""
    d = docx.Document()
    d.add_paragraph("Installation Guide", style="Title")
    d.add_heading("Setup", level=1)
    d.add_paragraph("Run the installer, then   restart.")
    d.add_paragraph("Download it", style="List Number")
    d.add_paragraph("Check the signature", style="List Number")
    d.add_heading("Options", level=2)
    table = d.add_table(rows=3, cols=2)
    for r, row in enumerate([("Option", "Meaning"), ("--quiet", "no output"), ("--yes", "")]):
        for c, text in enumerate(row):
            table.cell(r, c).text = text
    d.add_paragraph("Linux", style="List Bullet")
    d.add_paragraph("Debian", style="List Bullet 2")
    d.add_paragraph("Windows", style="List Bullet")
    d.add_heading("Troubleshooting", level=1)
    p = d.add_paragraph("First line")
    p.add_run().add_break()
    p.add_run("second line")
    d.add_paragraph("Reinstall", style="List Number")
    merged = d.add_table(rows=2, cols=3)
    merged.cell(0, 0).merge(merged.cell(0, 1)).text = "Both"
    merged.cell(0, 2).text = "Third"
    for c, text in enumerate(("a", "b", "c")):
        merged.cell(1, c).text = text
    return d


def test_registered_for_docx() -> None:
    assert Reader.registry["docx"].suffixes == (".docx",)


def test_body_order_headings_lists_and_tables() -> None:
    doc = read(guide())
    assert doc.text == (
        "Installation Guide\n\nSetup\n\nRun the installer, then restart.\n\n"
        "1. Download it\n2. Check the signature\n\nOptions\n\n"
        "Option | Meaning\n--quiet | no output\n--yes | \n\n"
        "- Linux\n  - Debian\n- Windows\n\nTroubleshooting\n\nFirst line\nsecond line\n\n"
        "3. Reinstall\n\nBoth | Third\na | b | c\n"
    )
    assert [(h.level, h.title) for h in doc.headings] == [
        (1, "Installation Guide"),
        (1, "Setup"),
        (2, "Options"),
        (1, "Troubleshooting"),
    ]
    for h in doc.headings:
        assert doc.text[h.char_start :].startswith(h.title + "\n")
    assert doc.section_at(doc.text.index("--quiet")) == ("Setup", "Options")
    assert doc.section_at(doc.text.index("Reinstall")) == ("Troubleshooting",)


def test_title_from_core_properties_else_the_title_paragraph() -> None:
    d = guide()
    assert read(d).title == "Installation Guide"
    d.core_properties.title = "  The  Guide "
    assert read(d).title == "The Guide"
    plain = docx.Document()
    plain.add_paragraph("No title here.")
    assert read(plain).title is None


def _numbering(d: docx.document.Document) -> int:
    """A list definition of two levels (decimal from 3, then lower letters); its numId."""
    numbering = d.part.numbering_part.element
    numbering.insert(
        0,
        parse_xml(
            f'<w:abstractNum {nsdecls("w")} w:abstractNumId="90">'
            '<w:lvl w:ilvl="0"><w:start w:val="3"/><w:numFmt w:val="decimal"/></w:lvl>'
            '<w:lvl w:ilvl="1"><w:start w:val="1"/><w:numFmt w:val="lowerLetter"/></w:lvl>'
            "</w:abstractNum>"
        ),
    )
    numbering.append(
        parse_xml(f'<w:num {nsdecls("w")} w:numId="90"><w:abstractNumId w:val="90"/></w:num>')
    )
    return 90


def test_lists_by_numbering_properties_follow_their_definition() -> None:
    d = docx.Document()
    num_id = _numbering(d)
    for text, level in [("first", 0), ("sub one", 1), ("sub two", 1), ("second", 0), ("x", 1)]:
        p = d.add_paragraph(text)
        num_pr = p._p.get_or_add_pPr().get_or_add_numPr()
        num_pr.get_or_add_numId().val = num_id
        num_pr.get_or_add_ilvl().val = level
    assert read(d).text == "3. first\n  a. sub one\n  b. sub two\n4. second\n  a. x\n"


def test_corrupt_files_are_rejected() -> None:
    good = io.BytesIO()
    guide().save(good)
    not_word = io.BytesIO()
    with zipfile.ZipFile(not_word, "w") as z:
        z.writestr("hello.txt", "not a Word document")
    for data in (b"plain text, not a zip", good.getvalue()[:2000], not_word.getvalue()):
        with pytest.raises(ReadError) as err:
            Reader.registry["docx"]().read(data, "bad.docx")
        assert err.value.reason == "corrupt"
        assert err.value.detail.startswith("bad.docx: not a Word .docx file")


def test_a_document_without_text_is_empty_text() -> None:
    d = docx.Document()
    d.add_paragraph("   ")
    d.add_table(rows=2, cols=2)
    with pytest.raises(ReadError) as err:
        read(d, "blank.docx")
    assert err.value.reason == "empty_text" and "blank.docx" in err.value.detail
