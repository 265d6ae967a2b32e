"""A document's text cut for the document page: its chunks in order, each chunk's text cut
into plain runs and nugget runs, from the stored offsets alone (no string search, so a
highlight can never land on another occurrence of the same words).

Offsets: a chunk covers ``text[char_start:char_end]`` of its document; a nugget covers
``chunk.text[char_start:char_end]`` of its chunk (``schemas.tables.ChunkRow``, ``NuggetRow``).
Nuggets that overlap an earlier one of the same chunk cannot be drawn as a second ``<mark>``
around the same characters; they are returned in ``overlapping`` (listed, not drawn).

Example::

    >>> pieces = cut_document("Hi. Kubrick made it.", [
    ...     {"char_start": 4, "char_end": 20, "text": "Kubrick made it.",
    ...      "nuggets": [{"char_start": 0, "char_end": 7, "text": "Kubrick"}]}])
    >>> [(p.kind, p.text) for p in pieces]
    [('gap', 'Hi. '), ('chunk', 'Kubrick made it.')]
    >>> [(r.nugget is not None, r.text) for r in pieces[1].runs]
    [(True, 'Kubrick'), (False, ' made it.')]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    """Characters of a chunk: plain (``nugget`` None) or one nugget's exact text."""

    text: str
    nugget: dict[str, Any] | None = None


@dataclass
class Piece:
    """A stretch of the document: a ``chunk`` (with its runs) or a ``gap`` between chunks."""

    kind: str  # chunk | gap
    text: str
    chunk: dict[str, Any] | None = None
    runs: list[Run] = field(default_factory=list)
    overlapping: list[dict[str, Any]] = field(default_factory=list)


def cut_chunk(text: str, nuggets: list[dict[str, Any]]) -> tuple[list[Run], list[dict[str, Any]]]:
    """``(runs, overlapping)``: ``text`` as plain and nugget runs (nuggets by ``char_start``),
    and the nuggets left out because they overlap a drawn one."""
    runs: list[Run] = []
    overlapping: list[dict[str, Any]] = []
    at = 0
    for nugget in sorted(nuggets, key=lambda n: (n["char_start"], n["char_end"])):
        start, end = nugget["char_start"], nugget["char_end"]
        if start < at or end > len(text) or start >= end:
            overlapping.append(nugget)
            continue
        if start > at:
            runs.append(Run(text[at:start]))
        runs.append(Run(text[start:end], nugget))
        at = end
    if at < len(text):
        runs.append(Run(text[at:]))
    return runs, overlapping


def cut_document(text: str, chunks: list[dict[str, Any]]) -> list[Piece]:
    """The document ``text`` as gaps and chunks (chunks by ``char_start``; a chunk that
    starts inside the previous one starts where that one ends)."""
    pieces: list[Piece] = []
    at = 0
    for chunk in sorted(chunks, key=lambda c: c["char_start"]):
        start, end = max(chunk["char_start"], at), chunk["char_end"]
        if start > at:
            pieces.append(Piece("gap", text[at:start]))
        skip = start - chunk["char_start"]  # characters already shown by the previous chunk
        nuggets = [n for n in chunk.get("nuggets", []) if n["char_start"] >= skip]
        shifted = [
            {**n, "char_start": n["char_start"] - skip, "char_end": n["char_end"] - skip}
            for n in nuggets
        ]
        runs, overlapping = cut_chunk(chunk["text"][skip:], shifted)
        left_out = [n for n in chunk.get("nuggets", []) if n["char_start"] < skip]
        pieces.append(Piece("chunk", text[start:end], chunk, runs, overlapping + left_out))
        at = max(at, end)
    if at < len(text):
        pieces.append(Piece("gap", text[at:]))
    return pieces
