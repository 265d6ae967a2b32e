"""The explorer's pure parts: a document cut into chunks and nugget runs from the stored
offsets (``inference/server/ui/marks.py``), and where signing in may send a browser
(``inference/server/ui/gate.py``), and how a cited span is named in a link (``views.py``)."""

from __future__ import annotations

import pytest

from coinrag.inference.server.ui.gate import safe_next
from coinrag.inference.server.ui.marks import cut_chunk, cut_document
from coinrag.inference.server.ui.views import parse_cite

TEXT = "Intro. Kubrick made 2001. It is long. Clarke wrote it."


def _chunk(start: int, end: int, nuggets: list[tuple[int, int]]) -> dict:
    text = TEXT[start:end]
    return {
        "char_start": start,
        "char_end": end,
        "text": text,
        "nuggets": [
            {"nugget_id": f"n{s}", "char_start": s, "char_end": e, "text": text[s:e]}
            for s, e in nuggets
        ],
    }


def test_chunks_and_gaps_cover_the_text_once_and_marks_hold_the_nuggets_text() -> None:
    chunks = [_chunk(7, 37, [(0, 12), (13, 18)]), _chunk(38, len(TEXT), [(0, 6)])]
    pieces = cut_document(TEXT, chunks)
    assert [p.kind for p in pieces] == ["gap", "chunk", "gap", "chunk"]
    assert "".join(p.text for p in pieces) == TEXT
    for piece in pieces[1::2]:
        assert "".join(r.text for r in piece.runs) == piece.text
        for run in piece.runs:
            if run.nugget is not None:
                assert run.text == run.nugget["text"]
    marked = [r.text for p in pieces for r in p.runs if r.nugget]
    assert marked == ["Kubrick made", "2001.", "Clarke"]


def test_an_overlapping_nugget_is_listed_not_drawn() -> None:
    text = "Stanley Kubrick directed it."
    nuggets = [
        {"nugget_id": "a", "char_start": 0, "char_end": 15},
        {"nugget_id": "b", "char_start": 8, "char_end": 24},  # overlaps a
        {"nugget_id": "c", "char_start": 16, "char_end": 24},
    ]
    runs, overlapping = cut_chunk(text, nuggets)
    assert [(r.text, r.nugget and r.nugget["nugget_id"]) for r in runs] == [
        ("Stanley Kubrick", "a"),
        (" ", None),
        ("directed", "c"),
        (" it.", None),
    ]
    assert [n["nugget_id"] for n in overlapping] == ["b"]


def test_a_chunk_overlapping_the_previous_one_starts_where_it_ends() -> None:
    chunks = [_chunk(0, 20, [(7, 14)]), _chunk(15, 37, [(0, 4), (10, 14)])]
    pieces = cut_document(TEXT, chunks)
    assert "".join(p.text for p in pieces) == TEXT
    second = pieces[1]
    assert second.text == TEXT[20:37]
    assert [r.text for r in second.runs if r.nugget] == [TEXT[25:29]]
    assert [n["nugget_id"] for n in second.overlapping] == ["n0"]  # inside the shown part


@pytest.mark.parametrize(
    "target, expected",
    [
        ("/ui/documents?q=x", "/ui/documents?q=x"),
        ("/ui", "/ui"),
        (None, "/ui"),
        ("https://evil.example/ui", "/ui"),
        ("//evil.example/ui", "/ui"),
        ("/ui//evil.example", "/ui"),
        ("/uievil", "/ui"),
        ("/ui\\@evil", "/ui"),
        ("/query", "/ui"),
    ],
)
def test_sign_in_only_sends_to_a_page_of_the_explorer(target, expected) -> None:
    assert safe_next(target) == expected


@pytest.mark.parametrize(
    "cite, expected",
    [
        ("ch-1a2b:27-41", ("ch-1a2b", 27, 41)),
        ("ch:x:0-5", ("ch:x", 0, 5)),
        ("ch-1a2b:27", None),
        (":1-2", None),
        ("ch:-1-2", None),
        ("", None),
    ],
)
def test_a_cited_span_is_a_chunk_and_two_offsets(cite, expected) -> None:
    assert parse_cite(cite) == expected
