"""Headings of a PDF without an outline, found by their font size.

Most PDFs carry no outline (headless Chromium prints none by default, nor does a Word export
without bookmarks), yet their headings are plain to see: larger type than the body. So where
the outline gives no heading, a line is a heading when its font is at least ``HEADING_RATIO``
times the body's (the size that most characters of the document are set in), it holds a letter
and it is short (at most ``MAX_HEADING_CHARS``). Each larger size is a level up: the sizes found
(within ``SIZE_STEP`` points of each other counted as one) are ranked, the largest level 1, at
most ``MAX_LEVELS`` levels (smaller sizes all the last). A heading set on two or more lines
(wrapped) is one heading: consecutive heading lines of one size on one page, each starting
within ``WRAP_GAP`` line heights below the last (on the Python docs printed by Chromium the
lines of a wrapped title are 0.03-0.05 line heights apart, two headings in a row 0.57: the
heading's margin).

Worked example (``faq/programming`` printed by Chromium: body 14 pt): "Programming FAQ" (26 pt)
-> level 1, "General Questions" (20 pt) -> 2, "Is there a source code level debugger with
breakpoints, single-stepping, etc.?" (16 pt) -> 3; the Contents list (14 pt) is body text.

Sizes are PDFium's (``FPDFText_GetFontSize``: points, the text matrix applied), one a line
(:func:`line_size`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coinrag.tasks.readers.base import Heading

HEADING_RATIO = 1.1  # a heading's font at least this times the body's
MAX_HEADING_CHARS = 200  # a longer line is body text, whatever its size
MAX_LEVELS = 6
SIZE_STEP = 0.5  # points: sizes closer than this are one level
WRAP_GAP = 0.3  # line heights: a wrapped heading's next line starts within this below its last
MIN_SIZE = 2.0  # points: PDFium's made-up characters (line breaks) report 1


@dataclass(frozen=True)
class SizedLine:
    """One line of the document's text as read: where it starts (``offset``, a character of the
    document's text), its ``text``, font ``size`` (points), ``page`` (0-based) and its box's
    ``top`` and ``bottom`` (points, y up)."""

    offset: int
    text: str
    size: float
    page: int
    top: float
    bottom: float


def line_size(sizes: Sequence[float]) -> float:
    """A line's font size from its characters' (points): the most common, rounded to 0.1
    (ties: the larger); 0 for none. ``[14, 14, 13.5]`` -> 14.0."""
    counts = Counter(round(s, 1) for s in sizes if s >= MIN_SIZE)
    if not counts:
        return 0.0
    return max(counts, key=lambda s: (counts[s], s))


def body_size(lines: Sequence[SizedLine]) -> float:
    """The size most characters of ``lines`` are set in (0 for none)."""
    chars: Counter[float] = Counter()
    for line in lines:
        if line.size:
            chars[line.size] += len(line.text)
    return max(chars, key=lambda s: (chars[s], -s)) if chars else 0.0


def _levels(sizes: set[float]) -> Callable[[float], int]:
    """Size -> level: the largest 1, each size more than ``SIZE_STEP`` below the last one up."""
    ranked, level_of, level = sorted(sizes, reverse=True), {}, 0
    for i, size in enumerate(ranked):
        if i == 0 or ranked[i - 1] - size > SIZE_STEP:
            level += 1
        level_of[size] = min(level, MAX_LEVELS)
    return level_of.__getitem__


def _is_heading(line: SizedLine, body: float) -> bool:
    text = line.text.strip()
    return (
        line.size >= HEADING_RATIO * body
        and len(text) <= MAX_HEADING_CHARS
        and any(c.isalpha() for c in text)
    )


def font_headings(lines: Sequence[SizedLine]) -> tuple[Heading, ...]:
    """The headings of a document's ``lines`` (in reading order) by font size (see the
    module); ``()`` when nothing is set larger than the body."""
    body = body_size(lines)
    if not body:
        return ()
    marked = [_is_heading(line, body) for line in lines]
    level = _levels({line.size for line, heading in zip(lines, marked, strict=True) if heading})
    found: list[tuple[SizedLine, SizedLine, str]] = []  # (first line, last line, title)
    for i, line in enumerate(lines):
        if not marked[i]:
            continue
        if i > 0 and marked[i - 1] and _continues(found[-1][1], line):
            first, _, title = found[-1]
            found[-1] = (first, line, f"{title} {line.text.strip()}")
        else:
            found.append((line, line, line.text.strip()))
    return tuple(
        Heading(first.offset, level(first.size), " ".join(title.split()))
        for first, _, title in found
    )


def _continues(last: SizedLine, line: SizedLine) -> bool:
    """Whether ``line`` is the next line of the heading that ends with ``last``."""
    height = max(last.top - last.bottom, 1.0)
    return (
        line.page == last.page
        and abs(line.size - last.size) <= SIZE_STEP
        and line.top < last.top
        and last.bottom - line.top <= WRAP_GAP * height
    )
