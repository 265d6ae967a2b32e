"""reStructuredText (``.rst``, ``.rest``): the file's text as it is, with its section titles parsed.

A section title (docutils' rules, as Sphinx writes them) is one line of text under an adornment
line (one punctuation character repeated, at least as long as the title), and over one of the
same character and length where the title is overlined too. An underlined title starts at the
left margin; an overlined one may be inset. A title follows a blank line or the start of the
file (a line under a paragraph's last line is not one). Levels are the order in which adornment
styles first appear (a style is the character and whether it is overlined), as docutils assigns
them: the first style is level 1, the next new one level 2, and so on. Nothing indented under a
line ending in ``::`` (a literal block) is a title. A heading starts at its overline where it
has one, else at its title line; its title is the line cleaned of inline markup (roles,
backquotes, emphasis, a link's target). The document's title is its first level-1 title.

Worked example::

    "=====\\nGuide\\n=====\\n\\nIntro\\n-----\\n\\nSetup\\n-----\\n"
    -> headings (0, 1, "Guide"), (19, 2, "Intro"), (32, 2, "Setup"); title "Guide"

    ":mod:`re` --- Regular expressions" -> "re --- Regular expressions"
"""

from __future__ import annotations

import re

from coinrag.tasks.readers.base import Heading
from coinrag.tasks.readers.text import MarkedUpTextReader

ADORNMENT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")  # docutils' adornment characters
MIN_ADORNMENT = 2  # a shorter line is never an adornment (a one-character title "A" under "=")

_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")  # `text <target>`_ -> text
_ROLE = re.compile(r":[\w.:+-]+:`~?!?([^`<]*?)\s*(?:<[^`>]*>)?`")  # :ref:`dict <x>` -> dict
_MARKUP = re.compile(r"\*{1,2}|`{1,2}|\|")  # emphasis, literals, substitutions


def clean_title(line: str) -> str:
    """A title line without inline markup: ``":mod:`re` --- Regular expressions"`` ->
    ``"re --- Regular expressions"``; ``"New :ref:`dict <typesmapping>` implementation"`` ->
    ``"New dict implementation"``; ``"The ``with`` *statement*"`` -> ``"The with
    statement"``."""
    text = _ROLE.sub(r"\1", _LINK.sub(r"\1", line))
    text = re.sub(r"`([^`]+)`_{1,2}", r"\1", text)  # `named reference`_
    return " ".join(_MARKUP.sub("", text).split())


def _adornment(line: str) -> str | None:
    """The character of an adornment line (one punctuation character repeated, at least
    :data:`MIN_ADORNMENT` times, trailing blanks allowed), else None."""
    body = line.rstrip()
    if len(body) < MIN_ADORNMENT or body[0] not in ADORNMENT or body.count(body[0]) != len(body):
        return None
    return body[0]


def rst_headings(text: str) -> tuple[Heading, ...]:
    """Every section title of reST ``text``, in order (see the module)."""
    lines = text.splitlines(keepends=True)
    bodies = [line.rstrip("\r\n") for line in lines]
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    styles: list[tuple[str, bool]] = []
    out: list[Heading] = []
    in_literal = False  # inside a literal block: the indented lines after a line ending "::"
    i = 0
    while i < len(bodies) - 1:
        body = bodies[i]
        if in_literal:
            if not body.strip() or body[0].isspace():
                i += 1
                continue
            in_literal = False
        found = _title_at(bodies, i)
        if found is None:
            in_literal = body.rstrip().endswith("::")
            i += 1
            continue
        title_line, style, used = found
        if style not in styles:
            styles.append(style)
        title = clean_title(bodies[title_line])
        if title:
            out.append(Heading(starts[i], styles.index(style) + 1, title))
        i += used
    return tuple(out)


def _title_at(bodies: list[str], i: int) -> tuple[int, tuple[str, bool], int] | None:
    """``(title line, style, lines used)`` of a section title starting at line ``i``, else
    None. A title follows a blank line or the start."""
    if i > 0 and bodies[i - 1].strip():
        return None
    over = _adornment(bodies[i])
    if over is not None and i + 2 < len(bodies):  # overline, title, underline
        title, under = bodies[i + 1], bodies[i + 2]
        same = under.rstrip() == bodies[i].rstrip()
        if same and title.strip() and _adornment(title) is None:
            if len(bodies[i].rstrip()) >= len(title.rstrip()):
                return i + 1, (over, True), 3
    title = bodies[i]
    if not title.strip() or title[0].isspace() or _adornment(title) is not None:
        return None
    mark = _adornment(bodies[i + 1])
    if mark is None or len(bodies[i + 1].rstrip()) < len(title.rstrip()):
        return None
    return i, (mark, False), 2


class RstReader(MarkedUpTextReader, name="rst"):
    """A reStructuredText file: its text, untouched, and its section titles."""

    suffixes = (".rst", ".rest")
    version = "1"

    def headings(self, text: str) -> tuple[Heading, ...]:
        return rst_headings(text)
