"""The rules extractor: verbatim, ordered, word-aligned spans of bounded length."""

from __future__ import annotations

import re

import pytest

from coinrag.tasks.extractors.base import ExtractionRequest
from coinrag.tasks.extractors.none import NoExtractor
from coinrag.tasks.extractors.rules import RulesExtractor, segment_words

PASSAGES = [
    "Gabriel García Márquez (6 March 1927 – 17 April 2014) was a Colombian novelist, "
    "short-story writer, screenwriter, and journalist. He won the 1982 Nobel Prize in "
    "Literature. His best-known work is One Hundred Years of Solitude.",
    "2001: A Space Odyssey is a 1968 epic science fiction film produced and directed by Stanley "
    "Kubrick, who co-wrote the screenplay with Arthur C. Clarke. Its plot was inspired by several "
    'short stories optioned from Clarke, primarily "The Sentinel" (1951) and "Encounter in the '
    'Dawn" (1953). The film stars Keir Dullea, Gary Lockwood, William Sylvester, and Douglas '
    "Rain, and follows a voyage by astronauts, scientists, and the sentient supercomputer HAL 9000 "
    "to Jupiter to investigate an alien monolith.",
    "The Eiffel Tower is 330 m (1,083 ft) tall; it was the tallest structure in the world "
    "until 1930. Dr. Smith visited the U.S. embassy in Paris.\nIt opened on 31 March 1889.",
    "Short.",
    "",
]


def _check(text: str, spans: list[tuple[int, int]], min_words: int, max_words: int) -> None:
    prev_end = 0
    for s, e in spans:
        piece = text[s:e]
        assert piece and piece == piece.strip()
        assert s >= prev_end, "spans must be in document order and not overlap"
        assert s == 0 or text[s - 1].isspace(), f"starts mid-word: {piece!r}"
        assert e == len(text) or not text[e].isalnum(), f"ends mid-word: {piece!r}"
        assert min_words <= len(piece.split()) <= max_words, piece
        prev_end = e


@pytest.mark.parametrize("text", PASSAGES)
@pytest.mark.parametrize("bounds", [(3, 25), (2, 8), (5, 12)])
def test_spans_verbatim_ordered_bounded(text: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    ex = RulesExtractor(min_words=lo, max_words=hi, split_words=max(2 * lo, min(16, hi)))
    spans = ex.char_spans(text)
    _check(text, spans, lo, hi)
    assert ex.spans(text) == [text[s:e] for s, e in spans]
    for cand in ex.spans(text):
        assert cand in text


def test_sentences_and_abbreviations() -> None:
    spans = RulesExtractor().spans(PASSAGES[2])
    assert spans == [
        "The Eiffel Tower is 330 m (1,083 ft) tall",
        "it was the tallest structure in the world until 1930.",
        "Dr. Smith visited the U.S. embassy in Paris.",
        "It opened on 31 March 1889.",
    ]


def test_accented_names_and_numbers_stay_whole() -> None:
    spans = RulesExtractor(max_words=8, split_words=8).spans(PASSAGES[0])
    joined = " | ".join(spans)
    assert "García Márquez" in joined
    for cand in spans:
        assert not re.search(r"\bM$|\b19$|\b192$", cand)


def test_long_sentence_is_cut_at_a_clause() -> None:
    spans = RulesExtractor().spans(PASSAGES[1])
    assert "who co-wrote the screenplay with Arthur C. Clarke." in spans
    assert all(len(s.split()) <= 25 for s in spans)


def test_wrapped_paragraph_lines_do_not_end_sentences() -> None:
    """Docs hard-wrapped at ~70 columns (reST, Markdown, text): a line break inside a paragraph
    is a space; blank lines, bullets, directives, prompts and rules still end a sentence."""
    text = (
        "Why is Python slow?\n===================\n\nPython is an interpreted language, which\n"
        "makes it slower than compiled languages for\ntight loops. It is also dynamic.\n\n"
        "* first item of a list\n* second item of it\n\n.. note::\n   A note that wraps onto\n"
        "   a second line of the note.\n\n>>> x = 1 + 2\n>>> y = x * 3\n"
    )
    assert RulesExtractor(min_words=3).spans(text) == [
        "Why is Python slow?",
        "Python is an interpreted language, which\nmakes it slower than compiled languages for"
        "\ntight loops.",
        "It is also dynamic.",
        "* first item of a list",
        "* second item of it",
        "A note that wraps onto\n   a second line of the note.",
        ">>> x = 1 + 2",
        ">>> y = x * 3",
    ]
    import textwrap

    one_line = RulesExtractor().spans(PASSAGES[1])
    wrapped = RulesExtractor().spans(textwrap.fill(PASSAGES[1], 60))
    assert [" ".join(c.split()) for c in wrapped] == one_line


def test_segment_words_flags() -> None:
    ws = segment_words("Born: 1927 in Aracataca. Died in Mexico City!")
    ends = [ws.word(i) for i in range(len(ws)) if ws.clause_end[i]]
    assert ends == ["Born:", "Aracataca.", "City!"]
    assert [ws.word(i) for i in range(len(ws)) if ws.sentence_end[i]] == ["Aracataca.", "City!"]


def test_extract_interface() -> None:
    ex = RulesExtractor()
    reqs = [ExtractionRequest(f"k{i}", t) for i, t in enumerate(PASSAGES)]
    done: list[str] = []
    results = ex.extract(reqs, on_result=lambda r: done.append(r.key))
    assert [r.key for r in results] == [r.key for r in reqs]
    assert all(r.status == "ok" and r.calls == [] for r in results)
    assert results[-1].candidates == [] and results[-2].candidates == []
    assert sorted(done) == sorted(r.key for r in reqs)  # each result handed over once
    assert ex.fingerprint.startswith("extractor-")
    assert ex.fingerprint != RulesExtractor(max_words=20).fingerprint


def test_no_extractor() -> None:
    ex = NoExtractor()
    results = ex.extract([ExtractionRequest("a", "Some text here.")])
    assert results[0].status == "ok" and results[0].candidates == [] and results[0].calls == []
    assert ex.backend == "none" and ex.fingerprint.startswith("extractor-")
