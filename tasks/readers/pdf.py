"""PDF (``.pdf``) through PDFium (pypdfium2): the text layer of every page in reading order,
without running headers and footers, with end-of-line hyphenation rejoined; the page map with the
PDF's own page labels, the title from the metadata and the headings from the outline.

Each page, in four steps (page units: points, origin bottom-left, y up):

1. **Lines.** PDFium's text of the page, cut at the line breaks PDFium writes, and after a
   hyphen PDFium joined to text that does not go on below it (a page's last line, hyphenated,
   joined to the next page's header: :func:`_line_spans`); each line gets a box from the font
   boxes of its first and last visible characters.
2. **Running lines.** In the top and bottom ``BAND`` of the page height, lines are grouped into
   rows (vertical overlap); a row's key is its text with the whitespace dropped and every run of
   digits (or a row that is only a Roman numeral) made ``#``. A row whose (band, key) comes back
   on at least :func:`running_threshold` pages is a running header / footer and all its lines go,
   on every page. Headless Chromium's default ``12/5/26, 1:16 AM <title>`` and
   ``file:///... 3/7`` are such rows. A 2-page document loses a band row only when both pages
   have it; from 3 pages on a row must come back on ``max(3, 40 %)`` of the pages, so body text
   that merely repeats once is never taken. On any number of pages (a 1-page document too) a
   band row also goes when it marks itself (:func:`marks_itself`): a bottom row ending in the
   page's own counter ``n/N``, a top row holding the PDF's title and more (a date).
3. **Reading order.** PDFium's order is the content stream's: Chromium draws a code block after
   the paragraphs around it, and a two-column paper may be drawn in any order. The kept lines are
   ordered by recursive XY cuts: a region is cut at its widest blank gaps (every gap at least
   ``CUT_SHARE`` of the widest), across rows or across columns (rows on a tie), top to bottom and
   left to right, until no blank gap is left (then PDFium's order). Consecutive rows that share a
   blank column gap (two columns whose lines happen to align) are put back together and cut into
   columns. Lines on one row are then joined (no space where they touch). Known shortcuts: a
   table drawn cell by cell, with blank columns between its cells, reads column by column; code
   loses its indentation (PDFium gives none).
4. **Hyphenation.** A line ending in a hyphen right after a letter, followed by a line starting
   with a lower-case letter on the same page, is joined to it (:func:`hyphen_kept` says which
   hyphen stays: "exam-" + "ple" -> "example" where the document has "example", "built-" + "in"
   -> "built-in"); PDFium itself joins some of them and writes U+FFFE for the hyphen, decided
   the same way.

The pages are joined with a blank line (``PAGE_SEPARATOR``): page ``i``'s text starts at
``pages[i].char_start``. A PDF that needs a password (``encrypted``), that PDFium cannot parse
(``corrupt``), that has no pages (``empty``) or whose pages hold no text at all (``no_text_layer``:
a scan) is a :class:`ReadError`; a PDF with only an owner password (printing, copying
restrictions) opens without one and is read.

Worked example (``tests/fixtures/pdf/general.pdf``, 7 pages printed by headless Chromium)::

    PdfReader().read(data, "general.pdf")
    -> text "General Python FAQ\\nGo\\nContents\\n...", title "General Python FAQ — Python 3.11.2
       documentation", pages (0, 1, "1"), (1993, 2, "2"), ..., headings (0, 1, "General Python
       FAQ"), (1119, 2, "General Information"), ... (the first "General Information" in the
       text is the Contents list's; the outline points lower on the page)

PDFium is not thread-safe: reads in one process take turns (``_PDFIUM_LOCK``).
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from coinrag.tasks.readers.base import Heading, Page, ReadDocument, Reader, ReadError
from coinrag.tasks.readers.pdf_headings import (
    SizedLine,
    font_headings,
    line_size,
)

PAGE_SEPARATOR = "\n\n"
BAND = 0.08  # the top and bottom fraction of a page height where running lines are looked for
ROW_SPACE = 0.15  # a gap over this fraction of a line's height between two lines of a row: a space
CUT_SHARE = 0.8  # an XY cut splits at every gap at least this share of the region's widest gap
SIZE_SAMPLES = 9  # characters of a line whose font size is read (evenly spaced, both ends)
JOIN_DROP = 2.5  # text after a joined hyphen this many line heights lower: not the next line
HYPHENS = "-\u2010\u00ad\ufffe"  # hyphen-minus, hyphen, soft hyphen, PDFium's joined hyphen
_PDFIUM_LOCK = threading.Lock()
_WORD = re.compile(r"[^\W\d_]+(?:[-\u2010][^\W\d_]+)*")
_ROMAN = re.compile(r"(?i)m{0,3}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})")
# PDFium's FPDF_ERR_* after a failed open -> (reason, what is wrong). PDFium refuses a PDF without
# pages without setting an error, so _open sets FPDF_ERR_FILE first (a load from memory never
# sets it): still there after the failure, it means "no pages".
_OPEN_ERRORS = {
    2: ("empty", "PDFium finds no pages in it"),
    4: ("encrypted", "encrypted: a password is needed to open it"),
    5: ("encrypted", "encrypted with a security handler PDFium does not support"),
}


@dataclass(frozen=True)
class TextLine:
    """One line of a page: its ``text``, its box ``x0 <= x1``, ``y0 <= y1`` in points (origin
    bottom-left, y up) and its font ``size`` (points; 0: not measured)."""

    text: str
    x0: float
    y0: float
    x1: float
    y1: float
    size: float = 0.0

    @property
    def middle(self) -> float:
        return (self.y0 + self.y1) / 2

    def on_row_of(self, other: TextLine) -> bool:
        """Whether the two lines share a row: either's vertical middle inside the other's box."""
        return self.y0 <= other.middle <= self.y1 or other.y0 <= self.middle <= other.y1


# ---- 1. lines ---------------------------------------------------------------------------------


def page_lines(textpage: Any) -> list[TextLine]:
    """The non-blank lines of a pypdfium2 ``PdfTextPage`` in PDFium's order, stripped, each
    with the box of the font boxes of its first and last visible characters."""
    import pypdfium2.raw as pdfium_c

    text = textpage.get_text_range()
    # PDFium counts UTF-16 units: past a character outside the BMP, Python's index lags.
    units = list(accumulate((1 + (ord(c) > 0xFFFF) for c in text), initial=0))
    rect = pdfium_c.FS_RECTF()

    def box(i: int) -> tuple[float, float, float, float]:
        char = pdfium_c.FPDFText_GetCharIndexFromTextIndex(textpage.raw, units[i])
        if char < 0 or not pdfium_c.FPDFText_GetLooseCharBox(textpage.raw, char, rect):
            return (math.inf, math.inf, -math.inf, -math.inf)
        return (rect.left, min(rect.bottom, rect.top), rect.right, max(rect.bottom, rect.top))

    def size(first: int, last: int) -> float:
        """The font size of the line ``text[first:last + 1]``: the most common of its
        characters' at ``SIZE_SAMPLES`` evenly spaced places (both ends included)."""
        step = max(1, (last - first) // (SIZE_SAMPLES - 1))
        found = []
        for i in [*range(first, last, step), last]:
            char = pdfium_c.FPDFText_GetCharIndexFromTextIndex(textpage.raw, units[i])
            if char >= 0 and not text[i].isspace():
                found.append(pdfium_c.FPDFText_GetFontSize(textpage.raw, char))
        return line_size(found)

    out = []
    for start, end in _line_spans(text, box):
        piece = text[start:end]
        body = piece.strip()
        if not body:
            continue
        first = start + len(piece) - len(piece.lstrip())
        last = start + len(piece.rstrip()) - 1
        (a0, b0, a1, b1), (c0, d0, c1, d1) = box(first), box(last)
        x0, y0, x1, y1 = min(a0, c0), min(b0, d0), max(a1, c1), max(b1, d1)
        if x0 > x1 or y0 > y1:  # no box (a character PDFium made up): where the last line was
            x0, y0, x1, y1 = (out[-1].x1, out[-1].y0, out[-1].x1, out[-1].y1) if out else (0,) * 4
        out.append(TextLine(body, x0, y0, x1, y1, size(first, last)))
    return out


def _line_spans(
    text: str, box: Callable[[int], tuple[float, float, float, float]]
) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each line of a page's ``text``: cut at PDFium's line breaks, and
    after a U+FFFE (a hyphen PDFium joined to the next line's text) where that text does not go
    on below it (it is higher, or more than ``JOIN_DROP`` line heights lower): PDFium joins a
    page's last line, hyphenated, to the next text it draws, which may be Chromium's header at
    the top of the page."""
    for m in re.finditer(r"[^\r\n]+", text):
        start = m.start()
        for joint in re.finditer("\ufffe(?=\\S)", m.group()):
            at = m.start() + joint.start()
            before, after = box(at - 1), box(at + 1)
            height = before[3] - before[1]
            middle, next_middle = (before[1] + before[3]) / 2, (after[1] + after[3]) / 2
            if not (math.isfinite(middle) and math.isfinite(next_middle)):
                continue  # a character without a box: leave PDFium's join
            if next_middle > before[3] or middle - next_middle > JOIN_DROP * height:
                yield start, at + 1
                start = at + 1
        yield start, m.end()


# ---- 2. running headers and footers -----------------------------------------------------------


def running_threshold(n_pages: int) -> int | None:
    """On how many pages a band row must come back to be a running line (None: 1 page).

    >>> [running_threshold(n) for n in (1, 2, 3, 7, 35)]
    [None, 2, 3, 3, 14]
    """
    if n_pages < 2:
        return None
    return 2 if n_pages == 2 else max(3, math.ceil(0.4 * n_pages))


def row_key(row: list[TextLine]) -> str:
    """A band row's text as compared across pages: its lines left to right, whitespace dropped,
    runs of digits (or a row that is only a Roman numeral) as ``#``.

    >>> row_key([TextLine("3/7", 500, 0, 520, 9), TextLine("file:///a.html", 20, 0, 90, 9)])
    'file:///a.html#/#'
    """
    text = "".join(line.text for line in sorted(row, key=lambda line: line.x0))
    text = re.sub(r"\s+", "", text)
    return "#" if _ROMAN.fullmatch(text) and text else re.sub(r"\d+", "#", text)


def band_rows(lines: list[TextLine], bottom: float, top: float) -> Iterator[tuple[str, list[int]]]:
    """(band, indices of ``lines``) of each row in the top and bottom ``BAND`` of a page whose
    box runs from ``bottom`` to ``top``; a row: lines of overlapping height."""
    reach = BAND * (top - bottom)
    for band, inside in (
        ("top", lambda line: line.middle >= top - reach),
        ("bottom", lambda line: line.middle <= bottom + reach),
    ):
        picked = sorted(
            (i for i, line in enumerate(lines) if inside(line)), key=lambda i: -lines[i].middle
        )
        row: list[int] = []
        for i in picked:
            if row and not lines[i].on_row_of(lines[row[-1]]):
                yield band, row
                row = []
            row.append(i)
        if row:
            yield band, row


def marks_itself(row_text: str, band: str, page: int, n_pages: int, title: str | None) -> bool:
    """Whether a band row is a running line by its own text, on any number of pages: a bottom
    row ending in the page's own counter ``page/n_pages`` (Chromium's ``file:///... 1/1``), or a
    top row holding the document's title and more (Chromium's ``12/5/26, 1:16 AM <title>``).

    >>> marks_itself("file:///a.html 1/1", "bottom", 1, 1, None)
    True
    >>> marks_itself("12/5/26, 1:16 AM About — Docs", "top", 1, 1, "About — Docs")
    True
    >>> marks_itself("About — Docs", "top", 1, 1, "About — Docs")  # a heading like the title
    False
    """
    text = re.sub(r"\s+", " ", row_text).strip()
    if band == "bottom":
        return re.search(rf"(?:^|\s){page}\s?/\s?{n_pages}$", text) is not None
    title = re.sub(r"\s+", " ", title or "").strip()
    return bool(title) and title in text and text != title


def running_lines(
    pages: list[list[TextLine]], boxes: list[tuple[float, float]], title: str | None = None
) -> list[set[int]]:
    """For each page, the indices of its lines that are running headers / footers (see the
    module): band rows that repeat across pages, and rows that mark themselves
    (:func:`marks_itself`); ``boxes[i]``: page ``i``'s (bottom, top); ``title``: the PDF's."""
    threshold = running_threshold(len(pages))
    found: list[list[tuple[tuple[str, str], list[int]]]] = []
    own: list[set[int]] = []
    seen: Counter[tuple[str, str]] = Counter()
    for page, (lines, (bottom, top)) in enumerate(zip(pages, boxes, strict=True), start=1):
        rows = [
            ((band, row_key([lines[i] for i in row])), row)
            for band, row in band_rows(lines, bottom, top)
        ]
        found.append(rows)
        own.append(
            {
                i
                for (band, _), row in rows
                if marks_itself(_row_text(lines, row), band, page, len(pages), title)
                for i in row
            }
        )
        seen.update({key for key, _ in rows})
    running = {key for key, n in seen.items() if threshold is not None and n >= threshold}
    return [
        {i for key, row in rows if key in running for i in row} | mine
        for rows, mine in zip(found, own, strict=True)
    ]


def _row_text(lines: list[TextLine], row: list[int]) -> str:
    return " ".join(lines[i].text for i in sorted(row, key=lambda i: lines[i].x0))


# ---- 3. reading order -------------------------------------------------------------------------


def _gaps(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The blank gaps ``(low, high)`` between the ``(start, end)`` spans once merged.

    >>> _gaps([(0, 2), (5, 6), (1, 3)])
    [(3, 5)]
    """
    out = []
    reach = -math.inf
    for start, end in sorted(spans):
        if start > reach > -math.inf:
            out.append((reach, start))
        if end > reach:
            reach = end
    return out


def _column_gaps(lines: list[TextLine], region: list[int]) -> list[tuple[float, float]]:
    return _gaps([(lines[i].x0, lines[i].x1) for i in region])


def _split(region: list[int], at: list[float], cuts: list[float]) -> list[list[int]]:
    """``region`` split where its items' positions ``at`` pass the ascending ``cuts``."""
    parts: list[list[int]] = [[] for _ in range(len(cuts) + 1)]
    for i, pos in zip(region, at, strict=True):
        parts[bisect.bisect(cuts, pos)].append(i)
    return [p for p in parts if p]


def _same_columns(lines: list[TextLine], rows: list[list[int]]) -> list[list[int]]:
    """Consecutive rows that share a blank column gap merged again: two columns cut into rows
    by gaps that happen to run across both go back to being one region (to be cut into
    columns next)."""
    out = [rows[0]]
    shared = _column_gaps(lines, rows[0])
    for row in rows[1:]:
        mine = _column_gaps(lines, row)
        common = [
            (max(a, c), min(b, d)) for a, b in shared for c, d in mine if max(a, c) < min(b, d)
        ]
        if common:
            out[-1] = out[-1] + row
            shared = common
        else:
            out.append(row)
            shared = mine
    return out


def _cut(lines: list[TextLine], region: list[int]) -> list[list[int]] | None:
    """``region`` (indices into ``lines``) cut at its widest blank gaps (all those at least
    ``CUT_SHARE`` of the widest), in reading order, or None where no blank gap runs across it."""
    rows = _gaps([(-lines[i].y1, -lines[i].y0) for i in region])  # downwards
    columns = _column_gaps(lines, region)
    widest_row = max((b - a for a, b in rows), default=0.0)
    widest_column = max((b - a for a, b in columns), default=0.0)
    if widest_row <= 0 and widest_column <= 0:
        return None
    if widest_column > widest_row:
        cuts = [(a + b) / 2 for a, b in columns if b - a >= CUT_SHARE * widest_column]
        return _split(region, [(lines[i].x0 + lines[i].x1) / 2 for i in region], cuts)
    cuts = [(a + b) / 2 for a, b in rows if b - a >= CUT_SHARE * widest_row]
    parts = _split(region, [-lines[i].middle for i in region], cuts)
    merged = _same_columns(lines, parts)
    if len(merged) > 1:
        return merged
    if columns:  # every row shares a blank column gap: columns, however narrow the gap
        cuts = [(a + b) / 2 for a, b in columns if b - a >= CUT_SHARE * widest_column]
        return _split(region, [(lines[i].x0 + lines[i].x1) / 2 for i in region], cuts)
    return parts


def reading_order(lines: list[TextLine]) -> list[TextLine]:
    """``lines`` by recursive XY cuts (see the module), PDFium's order inside a region with no
    blank gap across it; lines on one row are joined."""
    ordered: list[int] = []
    todo = [list(range(len(lines)))] if lines else []
    while todo:
        region = todo.pop()
        parts = _cut(lines, region) if len(region) > 1 else None
        if parts is None:
            ordered += sorted(region)
        else:
            todo += reversed(parts)
    return join_rows([lines[i] for i in ordered])


def join_rows(lines: list[TextLine]) -> list[TextLine]:
    """Consecutive lines on one row, the next to the right, joined into one line: with a space
    where the gap is over ``ROW_SPACE`` of the line height."""
    out: list[TextLine] = []
    for line in lines:
        prev = out[-1] if out else None
        if prev is None or not line.on_row_of(prev) or line.x0 < prev.x1 - 1.0:
            out.append(line)
            continue
        gap = line.x0 - prev.x1
        space = " " if gap > ROW_SPACE * max(prev.y1 - prev.y0, line.y1 - line.y0) else ""
        out[-1] = TextLine(
            prev.text + space + line.text,
            prev.x0,
            min(prev.y0, line.y0),
            line.x1,
            max(prev.y1, line.y1),
            prev.size if len(prev.text) >= len(line.text) else line.size,
        )
    return out


# ---- 4. hyphenation ---------------------------------------------------------------------------


def vocabulary(texts: list[str]) -> Counter[str]:
    """How often each word (lower case; hyphenated compounds as one word) occurs in ``texts``."""
    return Counter(w.lower() for text in texts for w in _WORD.findall(text))


def hyphen_kept(left: str, right: str, hyphen: str, words: Counter[str]) -> str:
    """What stays of ``hyphen`` between word parts ``left`` and ``right`` split at a line end:
    ``""`` or a hyphen. A soft hyphen (U+00AD) goes. Otherwise the document decides: the joined
    word against the hyphenated compound, the more frequent wins. Where it cannot tell (neither
    occurs, or as often), a typesetter's hyphen U+2010 (what Chromium draws at a soft hyphen)
    goes, and a hyphen-minus (what people type in "built-in") stays.

    >>> words = vocabulary(["an example", "a built-in"])
    >>> [hyphen_kept(a, b, "-", words) for a, b in [("exam", "ple"), ("built", "in"), ("x", "y")]]
    ['', '-', '-']
    >>> hyphen_kept("hyphen", "ation", "\\u2010", words)
    ''
    """
    if hyphen == "\u00ad":
        return ""
    joined = words[(left + right).lower()]
    compound = words[f"{left}-{right}".lower()] + words[f"{left}\u2010{right}".lower()]
    if joined != compound:
        return "" if joined > compound else hyphen.replace("\ufffe", "-")
    return "" if hyphen == "\u2010" else "-"


_LINE_END = re.compile(rf"([^\W\d_]+)([{HYPHENS}])$")
_LINE_START = re.compile(r"([^\W\d_]+)")
_JOINED = re.compile(r"([^\W\d_]+)\ufffe([^\W\d_]+)")


def rejoin_hyphens(lines: list[TextLine], words: Counter[str]) -> list[TextLine]:
    """Lines with their end-of-line hyphenation rejoined: a line ending in a hyphen after a
    letter and a next line starting with a lower-case letter become one line, the hyphen kept or
    dropped by :func:`hyphen_kept`; PDFium's own joins (U+FFFE between letters) are decided the
    same way; a soft hyphen left inside a line is dropped (it is invisible), a U+FFFE left (not
    between letters) becomes "-".

    >>> lines = [TextLine(t, 0, 0, 1, 1) for t in ["a built-", "in, an exam\\u2010", "ple", "X-"]]
    >>> [line.text for line in rejoin_hyphens(lines, Counter())]
    ['a built-in, an example', 'X-']
    """
    out: list[TextLine] = []
    for line in lines:
        text = _JOINED.sub(
            lambda m: m[1] + hyphen_kept(m[1], m[2], "\ufffe", words) + m[2], line.text
        )
        line = replace(line, text=text)
        end = _LINE_END.search(out[-1].text) if out else None
        start = _LINE_START.match(text)
        if end and start and start[1][0].islower():
            kept = hyphen_kept(end[1], start[1], end[2], words)
            out[-1] = replace(out[-1], text=out[-1].text[: end.start(2)] + kept + text)
        else:
            out.append(line)
    return [
        replace(line, text=line.text.replace("\u00ad", "").replace("\ufffe", "-")) for line in out
    ]


# ---- the document -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _PageText:
    """A page as read: its final lines, where each starts in the page's text, and that text."""

    lines: list[TextLine]
    starts: list[int]
    text: str


def _page_text(lines: list[TextLine]) -> _PageText:
    starts, at = [], 0
    for line in lines:
        starts.append(at)
        at += len(line.text) + 1
    return _PageText(lines, starts, "\n".join(line.text for line in lines))


def _open(data: bytes, name: str) -> Any:
    """The pypdfium2 ``PdfDocument`` of ``data``, or a :class:`ReadError` saying why not."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    pdfium_c.FPDF_LoadDocument(b"", None)  # fails, and leaves FPDF_ERR_FILE as the last error
    try:
        doc = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        code = getattr(exc, "err_code", None)
        pdfium_says = str(exc).removeprefix("Failed to load document ").rstrip(".")
        reason, what = _OPEN_ERRORS.get(code, ("corrupt", f"not a readable PDF {pdfium_says}"))
        todo = {
            "empty": "nothing to read: leave it out of SOURCE",
            "encrypted": "remove the password (qpdf --decrypt --password=PW in.pdf out.pdf) "
            "and add the decrypted copy",
            "corrupt": "check that the file is a complete PDF (a download cut short?) and add "
            "it again",
        }[reason]
        raise ReadError(reason, f"{name}: {what}: {todo}") from None
    if len(doc) == 0:
        doc.close()
        raise ReadError("empty", f"{name}: the PDF has 0 pages: nothing to read")
    return doc


def _raw_pages(doc: Any, name: str) -> tuple[list[list[TextLine]], list[tuple[float, float]]]:
    """Each page's lines in PDFium's order, and its (bottom, top)."""
    import pypdfium2 as pdfium

    pages, boxes = [], []
    for i in range(len(doc)):
        try:
            page = doc[i]
            textpage = page.get_textpage()
        except pdfium.PdfiumError as exc:
            raise ReadError(
                "corrupt",
                f"{name}: PDFium cannot load page {i + 1} of {len(doc)} ({exc}): check that "
                "the file is a complete PDF and add it again",
            ) from None
        pages.append(page_lines(textpage))
        _, bottom, _, top = page.get_bbox()
        boxes.append((bottom, top))
        textpage.close()
        page.close()
    return pages, boxes


def _destination(bookmark: Any) -> tuple[int, float | None] | None:
    """(page index, y the bookmark points at or None) of an outline entry (its /Dest, or its
    GoTo action's: PDFium looks at both), or None."""
    dest = bookmark.get_dest()
    if dest is None or dest.get_index() is None:
        return None
    mode, pos = dest.get_view()
    y = {1: 1, 3: 0, 7: 0}.get(mode)  # XYZ: [left, top, zoom]; FitH, FitBH: [top]
    return dest.get_index(), (pos[y] if y is not None and len(pos) > y else None)


def outline_headings(doc: Any, pages: list[_PageText], starts: list[int]) -> tuple[Heading, ...]:
    """One :class:`Heading` per outline entry whose title is found on the page it points at
    (its words in order, any whitespace between), the occurrence nearest to the height it points
    at (else the first after the previous heading on that page); the others are skipped.
    ``starts[i]``: where page ``i``'s text starts in the document's text."""
    found: dict[int, Heading] = {}
    after = [0] * len(pages)
    for bookmark in doc.get_toc():
        title = " ".join(bookmark.get_title().split())
        where = _destination(bookmark)
        if not title or where is None or where[0] >= len(pages):
            continue
        index, y = where
        page = pages[index]
        pattern = r"\s+".join(map(re.escape, title.split()))
        hits = [m.start() for m in re.finditer(pattern, page.text)]
        if not hits:
            continue
        if y is None:
            hit = next((h for h in hits if h >= after[index]), hits[0])
        else:
            hit = min(hits, key=lambda h: abs(_line_at(page, h).y1 - y))
        after[index] = hit + 1
        offset = starts[index] + hit
        found.setdefault(offset, Heading(offset, bookmark.level + 1, title))
    return tuple(found[k] for k in sorted(found))


def sized_lines(pages: list[_PageText], starts: list[int]) -> list[SizedLine]:
    """Every line of the document in reading order, where it starts in the document's text
    (``starts[i]``: page ``i``'s start) and its font size."""
    return [
        SizedLine(starts[i] + at, line.text, line.size, i, line.y1, line.y0)
        for i, page in enumerate(pages)
        for line, at in zip(page.lines, page.starts, strict=True)
    ]


def _line_at(page: _PageText, offset: int) -> TextLine:
    return page.lines[bisect.bisect_right(page.starts, offset) - 1]


class PdfReader(Reader, name="pdf"):
    """A PDF with a text layer: its pages' text, page labels, title and outline (see the
    module)."""

    suffixes = (".pdf",)
    # 2: a band row that marks itself (its page counter, title and date) goes; 3: a line PDFium
    # joined after a page-end hyphen to text elsewhere on the page (a header) is cut there; 4:
    # without an outline, headings by font size (pdf_headings.py); 5: a title's lines within 0.3
    # line heights are one wrapped heading (two headings in a row stay two), sizes sampled
    version = "5"

    def read(self, data: bytes, name: str) -> ReadDocument:
        with _PDFIUM_LOCK:
            doc = _open(data, name)
            try:
                return _read(doc, name)
            finally:
                doc.close()


def _read(doc: Any, name: str) -> ReadDocument:
    raw, boxes = _raw_pages(doc, name)
    title = doc.get_metadata_value("Title").strip() or None
    drop = running_lines(raw, boxes, title)
    ordered = [
        reading_order([line for j, line in enumerate(lines) if j not in gone])
        for lines, gone in zip(raw, drop, strict=True)
    ]
    words = vocabulary([line.text for lines in ordered for line in lines])
    pages = [_page_text(rejoin_hyphens(lines, words)) for lines in ordered]
    if not any(page.text.strip() for page in pages):
        what = (
            f"PDFium finds no characters on any of its {len(pages)} pages"
            if not any(raw)
            else f"only running headers / footers ({sum(map(len, drop))} lines)"
        )
        raise ReadError(
            "no_text_layer",
            f"{name}: no text layer (scanned?): {what}; OCR it first (e.g. ocrmypdf) and add "
            "the OCRed PDF",
        )
    starts, at = [], 0
    for page in pages:
        starts.append(at)
        at += len(page.text) + len(PAGE_SEPARATOR)
    labels = [doc.get_page_label(i) or str(i + 1) for i in range(len(pages))]
    blank = [i + 1 for i, page in enumerate(pages) if not page.text.strip()]
    return ReadDocument(
        PAGE_SEPARATOR.join(page.text for page in pages),
        title,
        pages=tuple(Page(s, i + 1, labels[i]) for i, s in enumerate(starts)),
        headings=outline_headings(doc, pages, starts) or font_headings(sized_lines(pages, starts)),
        extra={"pages_without_text": blank} if blank else {},
    )
