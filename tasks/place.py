"""Where a span of a document is: the pages it touches and the heading path where it starts.

A document read from a file carries its page and heading maps (``schemas.tables.FileOrigin``:
``page_starts``/``page_labels``, ``heading_starts``/``heading_levels``/``heading_titles``);
:class:`DocumentMaps` holds them and :meth:`DocumentMaps.place` gives the
``schemas.tables.PlaceInDocument`` columns of any character range, which the chunk stage writes
on every chunk and the recover stage on every nugget.

Worked example (a PDF of three pages, labels i, 1, 2; headings "FAQ" at 0 and "Speed" at 40)::

    maps.place(35, 60) -> PlaceInDocument(path="faq.pdf", page_first=2, page_last=3,
                                          page_labels=["1", "2"], section=["FAQ"])

The section is the heading path at the span's first non-blank character, so a chunk that
starts on the blank line before a heading belongs to that heading's section.
"""

from __future__ import annotations

from dataclasses import dataclass

from coinrag.schemas.tables import FileOrigin, PlaceInDocument
from coinrag.tasks.readers.base import Heading, Page, pages_between, section_at


@dataclass(frozen=True)
class DocumentMaps:
    """A document's ``text`` with its page and heading maps (offsets into ``text``)."""

    text: str
    path: str | None = None
    pages: tuple[Page, ...] = ()
    headings: tuple[Heading, ...] = ()

    @classmethod
    def of(cls, text: str, origin: FileOrigin | None) -> DocumentMaps:
        """The maps of a document's ``text`` from its ``FileOrigin`` columns (a
        ``DocumentRow`` is one); None or null maps (JSONL / Parquet records, older rows) give
        empty maps."""
        if origin is None:
            return cls(text)
        starts, labels = origin.page_starts or [], origin.page_labels or []
        pages = tuple(
            Page(s, i + 1, labels[i] if i < len(labels) else str(i + 1))
            for i, s in enumerate(starts)
        )
        headings = tuple(
            Heading(s, lv, t)
            for s, lv, t in zip(
                origin.heading_starts or [],
                origin.heading_levels or [],
                origin.heading_titles or [],
                strict=True,
            )
        )
        return cls(text, origin.path, pages, headings)

    def place(self, char_start: int, char_end: int) -> PlaceInDocument:
        """Where ``text[char_start:char_end]`` is (all None but ``path`` for a document
        without maps; all None for one not read from a file)."""
        pages = pages_between(self.pages, char_start, char_end)
        section = None
        if self.headings:
            section = list(
                section_at(self.headings, _first_visible(self.text, char_start, char_end))
            )
        return PlaceInDocument(
            path=self.path,
            page_first=pages[0].number if pages else None,
            page_last=pages[-1].number if pages else None,
            page_labels=[p.label for p in pages] if pages else None,
            section=section or None,
        )


def _first_visible(text: str, start: int, end: int) -> int:
    """The offset of the first non-whitespace character of ``text[start:end]`` (``start``
    for an all-blank range)."""
    stripped = len(text[start:end]) - len(text[start:end].lstrip())
    return start + stripped if stripped < end - start else start
