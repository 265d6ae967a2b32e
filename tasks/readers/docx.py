"""Word (``.docx``): the body's paragraphs and tables in order, with its headings.

The text follows the conventions of every structured reader (``html.TextBuilder``): a heading
(a paragraph of style ``Heading 1`` .. ``Heading 9``, or of a style based on one; ``Title`` is
a level-1 heading) is a line of its own, recorded in ``headings``; paragraphs are separated by
a blank line, a line break inside one (``w:br``) is a line break; a list item (a paragraph with
numbering, its own or its style's, such as ``List Bullet`` and ``List Number``) is a line
``- item``, or ``3. item`` when its numbering format is not a bullet (``c. item``, ``iii. item``
for letters and roman numerals), numbered as Word numbers it (one counter a list definition and
level, continued across the document; a higher item restarts the deeper levels); nested levels
are indented by two spaces; a table is one line per row, its cells joined by `` | `` (a merged
cell once). What is not in the body's flow is left out: headers, footers, footnotes, comments,
text boxes and content controls.

The title: the core properties' title, else the first ``Title`` paragraph. A file python-docx
cannot open is a :class:`ReadError` ``corrupt``; a document without text ``empty_text``.

Worked example (a document of a Title "Guide", a Heading 1 "Setup", a paragraph "Run it.", two
``List Number`` items "a" and "b", a 1x2 table "x", "y")::

    -> "Guide\\n\\nSetup\\n\\nRun it.\\n\\n1. a\\n2. b\\n\\nx | y\\n"
       headings (0, 1, "Guide"), (7, 1, "Setup"); title "Guide"
"""

from __future__ import annotations

import io
import re
import zipfile
from typing import Any

from lxml import etree

from coinrag.tasks.readers.base import ReadDocument, Reader, ReadError
from coinrag.tasks.readers.layout import LINE_BREAK, TextBuilder, squash

_HEADING_STYLE = re.compile(r"heading ([1-9])", re.I)
_LIST_STYLE = re.compile(r"list (bullet|number)(?: ([2-9]))?", re.I)
_STYLE_DEPTH = 8  # how many base styles are followed to find a heading or list style
_ROMAN = tuple(
    zip(
        (1000, 900, 500, 400, 100, 90, 50, 40, 10, 9, 5, 4, 1),
        "M CM D CD C XC L XL X IX V IV I".split(),
        strict=True,
    )
)
_W = {"w": "http://schemas.openxmlformats.org/wordprocessingml/2006/main"}
_ABSTRACT = etree.XPath("./w:num[@w:numId=$num]/w:abstractNumId/@w:val", namespaces=_W)
_LEVEL = etree.XPath(
    "./w:abstractNum[@w:abstractNumId=$abstract]/w:lvl[@w:ilvl=$level]", namespaces=_W
)
_FORMAT = etree.XPath("./w:numFmt/@w:val", namespaces=_W)
_START = etree.XPath("./w:start/@w:val", namespaces=_W)


class _Numbering:
    """The numbering definitions of a document: a list item's marker, counted as Word does."""

    def __init__(self, document: Any) -> None:
        try:
            self.root = document.part.numbering_part.element
        except (KeyError, NotImplementedError):
            self.root = None
        self.counters: dict[tuple[str, int], int] = {}

    def marker(self, list_id: str, level: int, ordered: bool | None) -> str:
        """``"- "`` or ``"N. "`` for the next item of list ``list_id`` (a ``numId``, or a
        style name) at ``level``; ``ordered`` None: the numbering definition says."""
        num_fmt, start = self._format(list_id, level)
        if ordered is None:
            ordered = num_fmt not in ("bullet", "none")
        for key in [k for k in self.counters if k[0] == list_id and k[1] > level]:
            del self.counters[key]  # a higher item restarts the deeper levels
        n = self.counters.get((list_id, level), start - 1) + 1
        self.counters[(list_id, level)] = n
        return f"{number_text(n, num_fmt)}. " if ordered else "- "

    def _format(self, num_id: str, level: int) -> tuple[str, int]:
        """(``numFmt``, ``start``) of level ``level`` of list ``num_id`` (bullet, 1 unknown)."""
        if self.root is None or not num_id.isdigit():
            return "bullet", 1
        lvl = _LEVEL(
            self.root,
            num=num_id,
            abstract=(_ABSTRACT(self.root, num=num_id) or [""])[0],
            level=str(level),
        )
        if not lvl:
            return "bullet", 1
        fmt, start = _FORMAT(lvl[0]), _START(lvl[0])
        return (fmt[0] if fmt else "decimal"), int(start[0]) if start and start[0].isdigit() else 1


def number_text(n: int, num_fmt: str) -> str:
    """Item number ``n`` as Word writes it in format ``num_fmt``: ``lowerLetter`` 28 -> "bb",
    ``upperRoman`` 14 -> "XIV"; decimal for the other formats."""
    if num_fmt in ("lowerLetter", "upperLetter"):
        letter = "abcdefghijklmnopqrstuvwxyz"[(n - 1) % 26] * ((n - 1) // 26 + 1)
        return letter if num_fmt == "lowerLetter" else letter.upper()
    if num_fmt in ("lowerRoman", "upperRoman") and 0 < n < 4000:
        roman = ""
        for value, digits in _ROMAN:
            count, n = divmod(n, value)
            roman += digits * count
        return roman.lower() if num_fmt == "lowerRoman" else roman
    return str(n)


def _styles(paragraph: Any) -> list[Any]:
    """The paragraph's style and the styles it is based on, nearest first."""
    out, style = [], paragraph.style
    while style is not None and len(out) < _STYLE_DEPTH:
        out.append(style)
        style = style.base_style
    return out


def heading_level(paragraph: Any) -> int | None:
    """The heading level of ``paragraph`` (``Title`` 1, ``Heading N`` N), None: not one."""
    for style in _styles(paragraph):
        name = style.name or ""
        if name.lower() == "title":
            return 1
        m = _HEADING_STYLE.fullmatch(name)
        if m:
            return int(m.group(1))
    return None


def list_place(paragraph: Any) -> tuple[str, int, bool | None] | None:
    """(list id, level, ordered) of a list paragraph, None: not one. ``ordered`` is None when
    the numbering definition decides; a ``List Bullet 2`` style is level 1."""
    styles = _styles(paragraph)
    for p_pr in [paragraph._p.pPr, *(s.element.pPr for s in styles)]:
        num_pr = None if p_pr is None else p_pr.numPr
        if num_pr is not None and num_pr.numId is not None:
            if num_pr.numId.val == 0:
                return None  # numbering switched off
            level = num_pr.ilvl.val if num_pr.ilvl is not None else _style_level(styles)
            return str(num_pr.numId.val), level, None
    for style in styles:
        m = _LIST_STYLE.fullmatch(style.name or "")
        if m:
            return style.name, _style_level(styles), m.group(1).lower() == "number"
    return None


def _style_level(styles: list[Any]) -> int:
    for style in styles:
        m = _LIST_STYLE.fullmatch(style.name or "")
        if m:
            return int(m.group(2) or 1) - 1
    return 0


def paragraph_text(paragraph: Any) -> str:
    """The paragraph's text as shown: white space squashed, a ``w:br`` a line break."""
    return squash(paragraph.text.replace("\n", LINE_BREAK))


def write_table(out: TextBuilder, table: Any) -> None:
    """One line a row, cells joined by `` | ``; a cell merged across columns counted once."""
    out.end_run()
    for row in table.rows:
        seen: set[int] = set()
        cells = []
        for cell in row.cells:
            if id(cell._tc) in seen:
                continue
            seen.add(id(cell._tc))
            cells.append(" ".join(filter(None, map(paragraph_text, cell.paragraphs))))
        if any(cells):
            out.line(" | ".join(cells), run="table")
    out.end_run()


class DocxReader(Reader, name="docx"):
    """A Word ``.docx`` file: its body's paragraphs, lists and tables, and its headings."""

    suffixes = (".docx",)
    version = "1"

    def read(self, data: bytes, name: str) -> ReadDocument:
        import docx
        from docx.opc.exceptions import OpcError
        from docx.table import Table

        try:
            document = docx.Document(io.BytesIO(data))
        except (zipfile.BadZipFile, KeyError, ValueError, OpcError, etree.LxmlError) as exc:
            raise ReadError(
                "corrupt",
                f"{name}: not a Word .docx file python-docx can open ({type(exc).__name__}: "
                f"{exc}); open it in Word or LibreOffice and save it again as .docx",
            ) from None
        out, numbering, first_title = TextBuilder(), _Numbering(document), None
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                write_table(out, block)
                continue
            text = paragraph_text(block)
            level = heading_level(block)
            place = None if level is not None else list_place(block)
            if level is not None:
                out.heading(level, text)
                if first_title is None and (block.style.name or "").lower() == "title":
                    first_title = text or None
            elif place is not None:
                marker = numbering.marker(*place)
                if text:
                    indent = "  " * place[1]
                    body = text.replace("\n", "\n" + indent + " " * len(marker))
                    out.line(indent + marker + body, run="list")
            else:
                out.line(text)
        text = out.text()
        if not text.strip():
            raise ReadError("empty_text", f"{name}: the document has no text in its body")
        title = squash(document.core_properties.title or "") or first_title
        return ReadDocument(text, title, headings=tuple(out.headings))
