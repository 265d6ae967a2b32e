"""The ``section`` chunker: chunks that start at the document's headings.

A document's headings (``TokenizedText.heading_starts``: the char offsets of its heading lines,
from the reader's heading map) cut it into sections, each from its heading to the next heading
(the text before the first heading is a section too). Positions are token cut indices, as in
``tasks/chunk_content.py``: cut ``c`` means a chunk ends before token ``c``.

1. A section that fits (at most ``chunk_size`` tokens) is never split. Consecutive sections
   that fit share a chunk: from a chunk's start, the chunk takes every following whole section
   that still fits, so each chunk starts at a heading and ends before one.
2. A long section (more than ``chunk_size``) starts a chunk at its heading and its last chunk
   ends at its end, so what comes after it is chunked as if the section were untouched: an edit
   inside a section moves only the cuts between its edit and its end. (Except: a chunk that
   would hold fewer than ``chunk_size / MIN_FILL`` tokens before a long section's heading
   continues into the section, and no chunk of a long section's tail is left that small.)
3. Inside a long section, a chunk starting at ``a`` ends at the best cut in its window
   ``(a, a + chunk_size]``, searching first the second half ``(a + chunk_size/2, ...]`` and
   taking the last cut of the first kind found there:

   - a block boundary: the start of a paragraph (a line after a blank line), of a fenced code
     block (its opening fence line), of a table (its first row) or the line after one ends;
   - a sentence end (the ``sentence`` chunker's rule, :func:`tasks.chunk.is_sentence_cut`);
   - a line start; then a word start;

   then the same kinds in the first half; then a line start inside a fenced code block; then
   any word start; then the window's end. No cut lands inside a fenced code block or a table
   row (a line with cells joined by ``" | "``) while another is possible.

The text conventions are the readers' (``tasks/readers``): a heading is its own line, paragraphs
are separated by blank lines, a table is one line per row with cells joined by ``" | "``, code
blocks are fenced by lines starting with ```` ``` ```` or ``~~~`` (closed by a fence of the same
character at least as long). Indented code is not told apart from indented prose (reST indents
every directive's body), so its blank lines are paragraph boundaries. A heading offset that is
not a line start counts from its line's start; a line start that is not a token boundary (a
whitespace token spanning it) moves back to the last boundary before it.

Worked example (chunk_size 8, so ``MIN_FILL`` gives 1 token; headings start sections A, B, C,
D; C is one sentence on one line, one token per word, so its cuts are at word starts)::

    sections  A [0, 3)  B [3, 6)  C [6, 20)  D [20, 22)
    chunks    [0, 6)      A and B share a chunk (6 <= 8 tokens; A, B and C would not fit)
              [6, 14)     C is long: a chunk starts at its heading, ends at the last word start
              [14, 20)    C's last chunk ends at its end, though D would fit in it
              [20, 22)    D
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from coinrag.tasks.chunk import Chunker, TokenizedText, back_off, is_sentence_cut
from coinrag.tasks.chunk_content import token_text

SECTION_VERSION = 1  # bump when a change moves the cuts: every section chunk id changes
MIN_FILL = 8  # no chunk shorter than chunk_size / MIN_FILL where a section rule allows
TABLE_CELL_SEPARATOR = " | "  # between a table row's cells (the readers' convention)
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")


@dataclass(frozen=True)
class Lines:
    """The line structure of a text: line ``i`` starts at char ``starts[i]``; ``code[i]``: it
    belongs to a fenced code block (fences included), ``opens[i]``: it is an opening fence,
    ``row[i]``: it is a table row, ``blank[i]``: it holds only whitespace."""

    starts: list[int]
    code: list[bool]
    opens: list[bool]
    row: list[bool]
    blank: list[bool]

    def line_of(self, pos: int) -> int:
        """The line holding char ``pos``."""
        return bisect.bisect_right(self.starts, pos) - 1

    def block_start(self, i: int) -> bool:
        """Whether a chunk starting at line ``i`` starts a block: a paragraph, a code block, a
        table, or what follows a code block or a table."""
        if i == 0 or self.blank[i] or self.interior(i):
            return False
        prev = i - 1
        return (
            self.blank[prev]
            or self.opens[i]
            or self.code[prev]  # the line after a closing fence
            or self.row[i] != self.row[prev]
        )

    def interior(self, i: int) -> bool:
        """Whether the start of line ``i`` lies inside a fenced code block (between its
        opening fence line and the line after its closing fence)."""
        return self.code[i] and not self.opens[i]


def text_lines(text: str) -> Lines:
    """The :class:`Lines` of ``text``. A fence-like line that no fence closes, or that is a
    reST title's underline or overline (``Title\\n~~~~~``), is not a fence.

    >>> ls = text_lines("Intro.\\n\\n```\\nx = 1\\n```\\na | b\\n")
    >>> ls.starts, ls.code
    ([0, 7, 8, 12, 18, 22], [False, False, True, True, True, False])
    >>> ls.row
    [False, False, False, False, False, True]
    """
    raw = text.splitlines(keepends=True) or [""]
    bodies = [line.rstrip("\r\n") for line in raw]
    starts = list(itertools.accumulate((len(line) for line in raw[:-1]), initial=0))
    code = [False] * len(bodies)
    opens = [False] * len(bodies)
    for i, j in _fenced_blocks(bodies):
        opens[i] = True
        code[i : j + 1] = [True] * (j + 1 - i)
    row = [not c and TABLE_CELL_SEPARATOR in body for c, body in zip(code, bodies, strict=True)]
    return Lines(starts, code, opens, row, [not body.strip() for body in bodies])


def _fenced_blocks(bodies: list[str]) -> Iterator[tuple[int, int]]:
    """``(opening line, closing line)`` of each fenced code block of the lines ``bodies``."""
    fences = [_FENCE.match(body) for body in bodies]
    i = 0
    while i < len(bodies):
        m = fences[i]
        j = None
        if (
            m
            and not (m.group(1)[0] == "`" and "`" in bodies[i][m.end() :])  # inline code
            and not _title_adornment(bodies, i)
        ):
            j = next(
                (k for k in range(i + 1, len(bodies)) if _closes(fences[k], m, bodies[k])), None
            )
        if j is None:
            i += 1
        else:
            yield i, j
            i = j + 1


def _title_adornment(bodies: list[str], i: int) -> bool:
    """Whether line ``i`` is a run of ``~`` (reST's, never a Markdown fence's backticks) under
    a title at most as long (an unindented text line), or over one with the same run under it.
    """

    run = bodies[i].rstrip()
    if set(run) != {"~"}:
        return False

    def title(k: int) -> bool:
        line = bodies[k].rstrip() if 0 <= k < len(bodies) else ""
        return (
            bool(line)
            and not line[0].isspace()
            and len(line) <= len(run)
            and not _FENCE.match(line)
        )

    return title(i - 1) or (title(i + 1) and i + 2 < len(bodies) and bodies[i + 2].rstrip() == run)


def _closes(fence: re.Match[str] | None, opening: re.Match[str], body: str) -> bool:
    """Whether a line (``body``, its fence match ``fence``) closes the block ``opening`` opened:
    a fence of the same character, at least as long, and nothing after it."""
    return (
        fence is not None
        and fence.group(1)[0] == opening.group(1)[0]
        and len(fence.group(1)) >= len(opening.group(1))
        and not body[fence.end() :].strip()
    )


class SectionCuts:
    """Where the section chunker cuts one tokenized document of ``chunk_size``-token chunks:
    :meth:`end` gives the end of the chunk starting at a cut (see the module's rules)."""

    def __init__(self, doc: TokenizedText, chunk_size: int) -> None:
        self.doc = doc
        self.size = chunk_size
        self.min_fill = max(1, chunk_size // MIN_FILL)
        n = len(doc.ids)
        self.pos = [0, *doc.ends]  # pos[c] = char offset of cut c
        self.lines = lines = text_lines(doc.text)
        at_line = [self.cut_at(p) for p in lines.starts]
        inner = range(1, len(lines.starts))
        self.blocks = _inside(n, {at_line[i] for i in inner if lines.block_start(i)})
        self.breaks = _inside(n, {at_line[i] for i in inner if not lines.interior(i)})
        self.code_breaks = _inside(n, {at_line[i] for i in inner if lines.interior(i)})
        heads = {at_line[lines.line_of(h)] for h in doc.heading_starts if h < len(doc.text)}
        heads = _inside(n, heads)
        self.section_starts = [0, *heads]
        self.section_ends = [*heads, n]

    def cut_at(self, pos: int) -> int:
        """The last cut at or before char ``pos`` (after the last token ending there, so never
        between the byte-level tokens of one character)."""
        return bisect.bisect_right(self.pos, pos) - 1

    def end(self, a: int) -> int:
        """The end of the chunk starting at cut ``a`` (in ``(a, a + chunk_size]``)."""
        starts, ends = self.section_starts, self.section_ends
        i = bisect.bisect_right(starts, a) - 1
        if ends[i] - a > self.size:  # a long section's head or middle
            return self.inside_cut(a, min(a + self.size, ends[i] - self.min_fill))
        if self._long(i):  # a long section's tail ends with it
            return ends[i]
        j = i
        while j + 1 < len(starts) and ends[j + 1] - a <= self.size:
            j += 1  # the next section fits whole too
        if j + 1 < len(starts) and self._long(j + 1) and ends[j] - a < self.min_fill:
            # a tiny chunk before a long section: fill it from that section
            return self.inside_cut(a, min(a + self.size, ends[j + 1] - self.min_fill))
        return ends[j]

    def _long(self, i: int) -> bool:
        """Whether section ``i`` is longer than ``chunk_size``."""
        return self.section_ends[i] - self.section_starts[i] > self.size

    def inside_cut(self, a: int, b: int) -> int:
        """The best cut in ``(a, b]`` (the module's rule 3)."""
        lo = a + max(1, self.size // 2)
        for first, last in ((lo + 1, b), (a + 1, lo)):
            cut = (
                _last_in(self.blocks, first, last)
                or self._last(first, last, self._prose_sentence)
                or _last_in(self.breaks, first, last)
                or self._last(first, last, self._prose_word)
            )
            if cut:
                return cut
        return (
            _last_in(self.code_breaks, a + 1, b)
            or self._last(a + 1, b, lambda c: self._next_text(c)[:1].isspace())
            or b
        )

    def _last(self, first: int, last: int, ok: Callable[[int], bool]) -> int | None:
        """The last cut ``c`` in ``[first, last]`` with ``ok(c)``, or None."""
        return next((c for c in range(last, first - 1, -1) if ok(c)), None)

    def _next_text(self, cut: int) -> str:
        return token_text(self.doc.text, self.doc.ends, cut)

    def _in_block(self, cut: int) -> bool:
        """Whether cut ``cut`` falls inside a fenced code block or inside a table row."""
        pos = self.pos[cut]
        i = self.lines.line_of(pos)
        if pos == self.lines.starts[i]:
            return self.lines.interior(i)
        return self.lines.code[i] or self.lines.row[i]

    def _prose_sentence(self, cut: int) -> bool:
        return is_sentence_cut(self.doc, cut) and not self._in_block(cut)

    def _prose_word(self, cut: int) -> bool:
        return self._next_text(cut)[:1].isspace() and not self._in_block(cut)


def _inside(n: int, cuts: set[int]) -> list[int]:
    """The cuts strictly inside a document of ``n`` tokens, ascending."""
    return sorted(c for c in cuts if 0 < c < n)


def _last_in(cuts: list[int], first: int, last: int) -> int | None:
    """The last of ``cuts`` (ascending) in ``[first, last]``, or None."""
    i = bisect.bisect_right(cuts, last) - 1
    return cuts[i] if i >= 0 and cuts[i] >= first else None


class SectionChunker(Chunker, name="section"):
    """Chunks that start at headings: a section that fits is never split, small ones share a
    chunk, a long one is cut at block ends, else sentence ends (the module's rules)."""

    def fingerprint_fields(self) -> dict[str, Any]:
        section = {"v": SECTION_VERSION, "min_fill": MIN_FILL, "cell": TABLE_CELL_SEPARATOR}
        return {**super().fingerprint_fields(), "section": section}

    def ranges(self, tokenizer: Any, doc: TokenizedText) -> list[tuple[int, int]]:
        cuts = SectionCuts(doc, self.chunk_size)
        n = len(doc.ids)
        out: list[tuple[int, int]] = []
        a = 0
        while a < n:
            b = back_off(tokenizer, doc, a, cuts.end(a))
            out.append((a, b))
            a = b
        return out
