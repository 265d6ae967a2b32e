"""Markdown (``.md``, ``.markdown``): the file's text as it is, with its headings parsed.

Headings: ATX (``## Title``, up to three spaces before, an optional closing run of ``#``) and
setext (a line underlined by ``===`` for level 1 or ``---`` for level 2, under a paragraph line).
Nothing inside a fenced code block (```` ``` ```` or ``~~~``, closed by a fence of the same
character at least as long) is a heading. The title is the first level-1 heading, if any.

Worked example::

    "# Guide\\n```\\n# not a heading\\n```\\nIntro\\n=====\\n"
    -> headings (0, 1, "Guide"), (32, 1, "Intro"); title "Guide"
"""

from __future__ import annotations

import re

from coinrag.tasks.readers.base import Heading
from coinrag.tasks.readers.text import MarkedUpTextReader

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*$")


def markdown_headings(text: str) -> tuple[Heading, ...]:
    """Every heading of Markdown ``text`` outside fenced code, in order (see the module)."""
    out: list[Heading] = []
    fence: str | None = None
    offset = 0
    prev: tuple[int, str] | None = None  # (offset, text) of a paragraph line a setext may close
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        start, offset = offset, offset + len(line)
        m = _FENCE.match(body)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                if not body[m.end() :].strip():
                    fence = None
            continue
        if m and not (m.group(1)[0] == "`" and "`" in body[m.end() :]):
            fence, prev = m.group(1), None
            continue
        atx = _ATX.match(body)
        if atx:
            title = (atx.group(2) or "").strip()
            if title:
                out.append(Heading(start, len(atx.group(1)), title))
            prev = None
            continue
        setext = _SETEXT.match(body)
        if setext and prev is not None:
            level = 1 if setext.group(1)[0] == "=" else 2
            out.append(Heading(prev[0], level, prev[1]))
            prev = None
            continue
        stripped = body.strip()
        is_paragraph = bool(stripped) and not body.startswith(("    ", "\t"))
        prev = (start, stripped) if is_paragraph and not _list_or_quote(stripped) else None
    return tuple(out)


def _list_or_quote(line: str) -> bool:
    return line.startswith((">", "- ", "* ", "+ ")) or bool(re.match(r"\d+[.)] ", line))


class MarkdownReader(MarkedUpTextReader, name="markdown"):
    """A Markdown file: its text, untouched, and its headings."""

    suffixes = (".md", ".markdown")
    version = "1"

    def headings(self, text: str) -> tuple[Heading, ...]:
        return markdown_headings(text)
