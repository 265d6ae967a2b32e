"""What a reader returns, and the :class:`Reader` plug-in kind (one subclass per file format).

A reader is a pure core: the bytes of one file in, a :class:`ReadDocument` out, or a
:class:`ReadError` whose ``reason`` is what the ``rejects`` table records (``no_text_layer``,
``encrypted``, ``corrupt``, ``undecodable``, ...). It never opens other files, never touches the
network and never downloads anything.

The text a reader returns is what the factory chunks and what every nugget is a verbatim span
of. Its maps point into that text:

- ``pages``: where each page starts (``Page.char_start``, ascending, the first at 0), its
  1-based number and the file's own label for it (a PDF's ``iv``, ``12``); empty for formats
  without pages;
- ``headings``: where each heading's line starts, its level (1 = top) and its title, in text
  order; a heading's section runs to the next heading of the same or a higher level.

Worked example (a Markdown file)::

    "# Intro\\nHello.\\n## Usage\\nRun it.\\n"
    -> headings (0, 1, "Intro"), (15, 2, "Usage")
    -> section_at(20) == ("Intro", "Usage")

A reader's ``version`` enters the fingerprint of every document it reads: bump it when a change
of the reader changes the text or the maps it returns, and the next build re-reads exactly the
files of that format.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, ClassVar

from coinrag.schemas.keys import fingerprint
from coinrag.schemas.registry import Registered, Registry
from coinrag.schemas.settings import READERS


class ReadError(ValueError):
    """The file cannot give a document: ``reason`` (a short snake_case word the ``rejects``
    table records) and ``detail`` (what a person reads: what is wrong, and what to do)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class LeftOut(ReadError):
    """The file reads fine but is not a document of its own (a page of links: an index or a
    table of contents): left out of the build and named in its output, not a reject (the
    build's exit code does not change)."""


@dataclass(frozen=True)
class Page:
    """A page of the text: it starts at character ``char_start``; ``number`` is 1-based;
    ``label`` the file's own label for it (a PDF's page label), else ``str(number)``."""

    char_start: int
    number: int
    label: str


@dataclass(frozen=True)
class Heading:
    """A heading whose line starts at character ``char_start``; ``level`` 1 is the top."""

    char_start: int
    level: int
    title: str


@dataclass(frozen=True)
class ReadDocument:
    """One file as the factory sees it: ``text`` (what is chunked), ``title`` (None: the file
    has none), and its ``pages`` and ``headings`` maps (offsets into ``text``, ascending)."""

    text: str
    title: str | None = None
    pages: tuple[Page, ...] = ()
    headings: tuple[Heading, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific facts, kept as metadata

    def page_span(self, char_start: int, char_end: int) -> tuple[Page, ...]:
        """The pages that characters ``[char_start, char_end)`` touch (empty without pages)."""
        return pages_between(self.pages, char_start, char_end)

    def section_at(self, offset: int) -> tuple[str, ...]:
        """The heading path at character ``offset`` (outermost first; empty before any)."""
        return section_at(self.headings, offset)


def pages_between(pages: tuple[Page, ...], char_start: int, char_end: int) -> tuple[Page, ...]:
    """The pages of ``pages`` (ascending ``char_start``) that ``[char_start, char_end)``
    touches; an empty range touches the page holding ``char_start``.

    >>> ps = (Page(0, 1, "i"), Page(10, 2, "1"), Page(25, 3, "2"))
    >>> [p.number for p in pages_between(ps, 5, 12)]
    [1, 2]
    """
    if not pages:
        return ()
    starts = [p.char_start for p in pages]
    first = max(bisect.bisect_right(starts, char_start) - 1, 0)
    last = max(bisect.bisect_left(starts, max(char_end, char_start + 1)) - 1, first)
    return tuple(pages[first : last + 1])


def section_at(headings: tuple[Heading, ...], offset: int) -> tuple[str, ...]:
    """The heading path at ``offset``: for each level, the last heading at or before
    ``offset`` that no later heading of a higher or equal level closed.

    >>> hs = (Heading(0, 1, "A"), Heading(5, 2, "B"), Heading(9, 2, "C"), Heading(20, 1, "D"))
    >>> section_at(hs, 10), section_at(hs, 3), section_at(hs, 25)
    (('A', 'C'), ('A',), ('D',))
    """
    stack: list[Heading] = []
    for h in headings:
        if h.char_start > offset:
            break
        while stack and stack[-1].level >= h.level:
            stack.pop()
        stack.append(h)
    return tuple(h.title for h in stack)


class Reader(Registered):
    """How one file format becomes a :class:`ReadDocument`: one subclass per format,
    registered by name (``class PdfReader(Reader, name="pdf")``), declaring the file
    ``suffixes`` it reads (lower case, with the dot) and its ``version``.

    ``options``: the reader's settings, those ``option_names`` names (``html_mode`` for HTML);
    they enter the fingerprint.
    """

    registry: ClassVar[Registry[Reader]] = Registry(
        "reader",
        READERS,
        modules={
            "text": "coinrag.tasks.readers.text",
            "markdown": "coinrag.tasks.readers.markdown",
            "rst": "coinrag.tasks.readers.rst",
            "html": "coinrag.tasks.readers.html",
            "pdf": "coinrag.tasks.readers.pdf",
            "docx": "coinrag.tasks.readers.docx",
        },
    )
    suffixes: ClassVar[tuple[str, ...]] = ()
    version: ClassVar[str] = ""
    option_names: ClassVar[tuple[str, ...]] = ()  # the read options it takes (``html_mode``)

    def __init__(self, **options: Any) -> None:
        self.options = options

    def read(self, data: bytes, name: str) -> ReadDocument:
        """The document in ``data`` (the whole file); ``name``: the file's path relative to
        SOURCE, for messages. Raise :class:`ReadError` for a file that gives no document."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """``keys.fingerprint("reader", ...)`` of the format, the version and the options."""
        return fingerprint(
            "reader", {"name": self.name, "version": self.version, "options": self.options}
        )
