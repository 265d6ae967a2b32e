"""Chunking invariants on the real SmolLM2 tokenizer (property tests)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coinrag.tasks.chunk import chunk_document, token_spans_pairs

WORDS = [
    "Gráinne",
    "Ní",
    "Mháille",
    "was",
    "the",
    "head",
    "of",
    "😀",
    "299,792,458",
    "m/s.",
    "Dynasty.",
    "—",
    "naïve",
    "東京",
    "\n\n",
    "end!",
    "(Irish:",
    "O’Malley)",
    "  ",
    "x",
]


def _check(tokenizer, text: str, size: int, method: str, heading_starts=()) -> None:
    rows = chunk_document(
        tokenizer,
        "d",
        "dv",
        text,
        tokenizer_fp="tok",
        chunk_size=size,
        method=method,
        heading_starts=heading_starts,
        run_id="r",
    )
    assert "".join(r.text for r in rows) == text
    assert [r.ordinal for r in rows] == list(range(len(rows)))
    prev_end = 0
    for r in rows:
        assert 1 <= r.n_tokens <= size
        assert r.text == text[r.char_start : r.char_end]
        assert r.char_start == prev_end
        prev_end = r.char_end
        assert tokenizer.decode(r.token_ids, clean_up_tokenization_spaces=False) == r.text
        spans = token_spans_pairs(r.token_spans)
        assert len(spans) == r.n_tokens
        assert spans[0][0] == 0 and spans[-1][1] == len(r.text)
        assert all(s <= e for s, e in spans)
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert len({r.chunk_id for r in rows}) == len(rows)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=300),
    size=st.integers(min_value=8, max_value=64),
    method=st.sampled_from(["fixed", "sentence", "content", "section"]),
)
def test_chunks_reconstruct_the_document(smollm2_tokenizer, words, size, method) -> None:
    text = " ".join(words)
    # for ``section``: a heading after each blank line, its offset at or inside its line
    headings = [m.end() + len(m.group()) % 2 for m in re.finditer(r"\n\n ?", text)]
    _check(smollm2_tokenizer, text, size, method, [h for h in headings if h <= len(text)])


def test_fixed_chunks_are_full_512_tokens_on_real_text(smollm2_tokenizer, sample_corpus) -> None:
    text = "\n\n".join(sample_corpus.read_text(encoding="utf-8").splitlines()) * 3
    rows = chunk_document(
        smollm2_tokenizer, "d", "dv", text, tokenizer_fp="tok", chunk_size=512, run_id="r"
    )
    assert all(r.n_tokens == 512 for r in rows[:-1])
    _check(smollm2_tokenizer, text, 512, "fixed")


def test_sentence_chunks_start_at_sentence_boundaries(smollm2_tokenizer) -> None:
    text = " ".join(f"Sentence number {i} says something about topic {i}." for i in range(200))
    rows = chunk_document(
        smollm2_tokenizer,
        "d",
        "dv",
        text,
        tokenizer_fp="tok",
        chunk_size=64,
        method="sentence",
        run_id="r",
    )
    assert len(rows) > 3
    for r in rows[1:]:
        assert r.text.startswith(" Sentence"), r.text[:20]


def test_unknown_chunker_is_refused(smollm2_tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown chunker"):
        chunk_document(
            smollm2_tokenizer, "d", "dv", "x y", tokenizer_fp="t", method="nope", run_id="r"
        )


def test_ids_are_deterministic_and_content_keys_follow_tokens(smollm2_tokenizer) -> None:
    text = "Alpha beta gamma. " * 100
    a = chunk_document(
        smollm2_tokenizer, "d", "dv1", text, tokenizer_fp="t", chunk_size=32, run_id="r1"
    )
    b = chunk_document(
        smollm2_tokenizer, "e", "dv2", text, tokenizer_fp="t", chunk_size=32, run_id="r2"
    )
    assert [r.content_key for r in a] == [r.content_key for r in b]  # same tokens, same content
    assert [r.chunk_id for r in a] != [r.chunk_id for r in b]  # other document, other rows
