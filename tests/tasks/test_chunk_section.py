"""The section chunker's rules (``tasks/chunk_section.py``) on the real SmolLM2 tokenizer: on the
reST sources of the Python docs and on generated documents of headings, paragraphs, lists,
tables and fenced code.

The invariants shared with the other chunkers (exact offsets, decode, size bound, emoji and
accents) are checked by ``tests/tasks/test_chunk.py``, which runs every chunker; the real pages
are checked for them here too.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from store_fixtures import rst_heading_starts

from coinrag.tasks.chunk import chunk_document, chunker_fingerprint, tokenize
from coinrag.tasks.chunk_section import MIN_FILL, SECTION_VERSION, SectionChunker, text_lines

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
# FAQ (many short sections), a library page (long sections, literal blocks), the tutorial, and a
# page whose subsections are underlined with "~~~~" (not code fences).
PAGES = ["faq/programming", "library/re", "tutorial/controlflow", "library/unittest.mock"]


def _rows(tokenizer, text: str, size: int, heading_starts=(), method: str = "section") -> list:
    return chunk_document(
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


def _check_invariants(tokenizer, text: str, rows: list, size: int) -> None:
    assert "".join(r.text for r in rows) == text
    for r in rows:
        assert 1 <= r.n_tokens <= size
        assert r.text == text[r.char_start : r.char_end]
        assert tokenizer.decode(r.token_ids, clean_up_tokenization_spaces=False) == r.text


def _check_section_rules(tokenizer, text: str, heading_starts, rows: list, size: int) -> None:
    """Sections that fit are whole in one chunk, and a chunk starting at a section takes the
    next section when it fits; a long section starts a chunk (or follows fewer than
    ``size / MIN_FILL`` tokens) and ends one. A section starts at the last token boundary at or
    before its heading line."""
    doc = tokenize(tokenizer, text)
    n = len(doc.ids)
    heads = sorted({bisect.bisect_right(doc.ends, h) for h in heading_starts} - {0, n})
    sections = [(s, e) for s, e in zip([0, *heads], [*heads, n], strict=True) if e > s]
    starts = [r.tok_start for r in rows]
    ends = {r.tok_end for r in rows}

    def chunk_at(t: int):
        return rows[bisect.bisect_right(starts, t) - 1]

    for i, (s, e) in enumerate(sections):
        r = chunk_at(s)
        where = f"section {i} {text[doc.ends[s - 1] if s else 0 :][:40]!r}"
        if e - s <= size:
            assert e <= r.tok_end, f"{where} ({e - s} tokens) is split"
            if r.tok_start == s and e == r.tok_end and i + 1 < len(sections):
                nxt_end = sections[i + 1][1]
                fits = sections[i + 1][1] - sections[i + 1][0] <= size
                assert not (fits and nxt_end - r.tok_start <= size), f"{where}: not filled"
        else:
            assert s - r.tok_start < max(1, size // MIN_FILL), f"{where}: long, starts no chunk"
            assert e in ends, f"{where}: long, its end ends no chunk"


@pytest.mark.skipif(not DOCS.is_dir(), reason="needs Debian's python3.11-doc")
@pytest.mark.parametrize("size", [512, 128])
@pytest.mark.parametrize("page", PAGES)
def test_section_rules_on_python_docs(smollm2_tokenizer, page, size) -> None:
    text = (DOCS / f"{page}.rst.txt").read_text(encoding="utf-8")
    heads = rst_heading_starts(text)
    assert len(heads) > 5
    rows = _rows(smollm2_tokenizer, text, size, heads)
    _check_invariants(smollm2_tokenizer, text, rows, size)
    _check_section_rules(smollm2_tokenizer, text, heads, rows, size)
    starts = {r.char_start for r in rows}
    assert len(starts & set(heads)) >= len(heads) // 3  # most chunks start at a heading
    assert not any(text_lines(text).code)  # reST's "~~~~" underlines are not fences


# ---------------------------------------------------------------------------- generated documents

WORDS = ["the", "café", "naïve", "😀", "東京", "river", "x", "is", "and", "O’Malley", "299,792"]
ENDS = [".", "!", "?", ".”", ""]
CODE_LINES = ["x = f(a, b)", "", "print('Done. Next!')", "# a comment. Another.", "    return x"]

words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)
sentences = st.builds(lambda w, end: w.capitalize() + end, words, st.sampled_from(ENDS))
blocks = st.one_of(
    st.tuples(st.just("heading"), words.map(lambda w: "# " + w)),
    st.tuples(st.just("paragraph"), st.lists(sentences, min_size=1, max_size=8).map(" ".join)),
    st.tuples(st.just("paragraph"), st.lists(sentences, min_size=2, max_size=6).map("\n".join)),
    st.tuples(
        st.just("list"),
        st.lists(sentences, min_size=1, max_size=4).map(lambda xs: "\n".join("- " + x for x in xs)),
    ),
    st.tuples(st.just("table"), st.lists(st.lists(sentences, min_size=2, max_size=4), max_size=6)),
    st.tuples(st.sampled_from(["```", "~~~~"]), st.lists(st.sampled_from(CODE_LINES), max_size=10)),
)


@dataclass
class Generated:
    """A generated document and where its headings, code blocks and table rows are."""

    text: str = ""
    headings: list[int] = field(default_factory=list)
    atomic: list[tuple[int, int]] = field(default_factory=list)  # code blocks and table rows

    def add(self, kind: str, body) -> tuple[int, int]:
        """Append a block (after a blank line); return its char span."""
        if self.text:
            self.text += "\n\n"
        start = len(self.text)
        if kind == "heading":
            self.headings.append(start)
        if kind == "table":
            rows = [" | ".join(cells) for cells in body or [["a", "b"]]]
            for row in rows:
                self.atomic.append((len(self.text), len(self.text) + len(row)))
                self.text += row + "\n"
            self.text = self.text[:-1]
            return start, len(self.text)
        if kind in ("```", "~~~~"):
            body = "\n".join([kind, *body, kind])
            self.atomic.append((start, start + len(body)))
        self.text += body
        return start, len(self.text)


def _generated(parts) -> Generated:
    doc = Generated()
    for kind, body in parts:
        doc.add(kind, body)
    return doc


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(blocks, min_size=1, max_size=40), size=st.integers(16, 96))
def test_section_rules_on_generated_documents(smollm2_tokenizer, parts, size) -> None:
    doc = _generated(parts)
    rows = _rows(smollm2_tokenizer, doc.text, size, doc.headings)
    _check_invariants(smollm2_tokenizer, doc.text, rows, size)
    _check_section_rules(smollm2_tokenizer, doc.text, doc.headings, rows, size)
    ends = tokenize(smollm2_tokenizer, doc.text).ends
    for x, y in doc.atomic:  # code blocks and table rows
        inside = [r for r in rows[:-1] if x < r.char_end < y]
        if bisect.bisect_right(ends, y) - bisect.bisect_right(ends, x) <= size // 2:
            assert not inside, f"cut inside {doc.text[x:y]!r}"  # a short one: never
        for r in inside:  # a long one: only when the chunk starts in it (no cut before it)
            assert r.char_start > x or not doc.text[r.char_start : x].strip(), r.text


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    before=st.lists(blocks, max_size=6),
    section=st.lists(st.lists(sentences, min_size=2, max_size=8), min_size=8, max_size=30),
    after=st.lists(blocks, max_size=10),
    inserted=sentences,
    where=st.floats(0.2, 0.8),
    size=st.integers(16, 64),
)
def test_an_edit_in_a_long_section_changes_no_chunk_after_it(
    smollm2_tokenizer, before, section, after, inserted, where, size
) -> None:
    """A sentence inserted in a long section: the chunks after the section, and those whose
    window ends before the edit, are unchanged (so are their nuggets, KV and embeddings)."""
    old = _generated(before)
    long_heading, _ = old.add("heading", "# Long")
    paragraphs = [old.add("paragraph", " ".join(p)) for p in section]
    after_heading, _ = old.add("heading", "# After")
    for kind, body in after:
        old.add(kind, body)
    x = paragraphs[int(where * len(section))][1]  # the sentence goes at this paragraph's end
    new_text = old.text[:x] + " " + inserted + old.text[x:]
    shift = len(inserted) + 1
    new_heads = [h if h < x else h + shift for h in old.headings]

    ends = tokenize(smollm2_tokenizer, old.text).ends
    long_start, long_end, x_tok = (
        bisect.bisect_right(ends, c) for c in (long_heading, after_heading, x)
    )
    if long_end - long_start <= size:
        event("the section fits")
        return
    old_rows = _rows(smollm2_tokenizer, old.text, size, old.headings)
    new_rows = _rows(smollm2_tokenizer, new_text, size, new_heads)
    after_old = [r.text for r in old_rows if r.char_start >= after_heading]
    after_new = [r.text for r in new_rows if r.char_start >= after_heading + shift]
    assert after_old and after_old == after_new
    limit = min(x_tok, long_end - max(1, size // MIN_FILL))
    m = sum(1 for r in old_rows if r.tok_start + size < limit)
    assert [r.text for r in old_rows[:m]] == [r.text for r in new_rows[:m]]


# ---------------------------------------------------------------------------- examples


def _sentence(i: int) -> str:
    return f"Sentence number {i} says something about topic {i}."


def _paragraph_boundary(text: str, cut: int) -> bool:
    """Whether char ``cut`` lies in the whitespace between two paragraphs."""
    before = text[:cut]
    around = (
        before[len(before.rstrip()) :] + text[cut:][: len(text[cut:]) - len(text[cut:].lstrip())]
    )
    return "\n\n" in around


def test_small_sections_share_a_chunk_and_start_it_at_their_heading(smollm2_tokenizer) -> None:
    parts = [f"# Part {i}\n\n{_sentence(i)} {_sentence(i + 1)}" for i in range(12)]
    text = "\n\n".join(parts)
    heads = [m.start() for m in re.finditer("^# ", text, re.M)]
    rows = _rows(smollm2_tokenizer, text, 96, heads)
    assert 1 < len(rows) < len(parts)  # several sections a chunk
    assert all(r.text.startswith("# Part") for r in rows)
    assert all(r.text.count("# Part") >= 2 for r in rows[:-1])
    fixed = _rows(smollm2_tokenizer, text, 96, heads, method="fixed")
    assert not all(r.text.startswith("# Part") for r in fixed)  # the test can fail


def test_a_long_section_falls_back_to_sentence_cuts(smollm2_tokenizer) -> None:
    text = "# Title\n\n" + " ".join(_sentence(i) for i in range(150)) + "\n\n# Next\n\nEnd."
    rows = _rows(smollm2_tokenizer, text, 64, [0, text.index("# Next")])
    body = [r for r in rows if not r.text.startswith("# Next")]
    assert (
        len(body) > 5 and rows[0].text.startswith("# Title") and rows[-1].text == "# Next\n\nEnd."
    )
    for r, nxt in zip(body, body[1:], strict=False):
        assert r.text.endswith("."), r.text[-20:]
        assert nxt.text.startswith(" Sentence"), nxt.text[:20]
    assert body[-1].text.endswith(".\n\n")  # the section's last chunk ends at its end


@pytest.mark.parametrize("headings", [True, False], ids=["section", "no headings"])
def test_a_long_section_is_cut_between_paragraphs(smollm2_tokenizer, headings) -> None:
    paragraphs = [" ".join(_sentence(3 * i + j) for j in range(3)) for i in range(40)]
    text = "# Title\n\n" + "\n\n".join(paragraphs)
    rows = _rows(smollm2_tokenizer, text, 128, [0] if headings else [])
    cuts = [r.char_start for r in rows[1:]]
    assert len(cuts) > 5 and all(_paragraph_boundary(text, c) for c in cuts)
    sentence_cuts = [r.char_start for r in _rows(smollm2_tokenizer, text, 128, method="sentence")]
    assert not all(_paragraph_boundary(text, c) for c in sentence_cuts[1:])  # the test can fail


@pytest.mark.parametrize("kind", ["code", "table"])
def test_a_code_block_or_table_is_not_cut_where_sentence_cuts(smollm2_tokenizer, kind) -> None:
    """A block that straddles where ``sentence`` cuts: ``section`` cuts before it."""
    if kind == "code":
        lines = ["```", *(f"print('Step {i}. Done.')" for i in range(8)), "```"]
    else:
        lines = [f"Row {i}. | Value {i}. | Note {i}." for i in range(8)]
    block = "\n".join(lines)
    prose = " ".join(_sentence(i) for i in range(9))
    text = f"# Title\n\n{prose}\n\n{block}\n\nAfter the block. " + " ".join(
        map(_sentence, range(40))
    )
    start, end = text.index(block), text.index(block) + len(block)
    inside = [r.char_start for r in _rows(smollm2_tokenizer, text, 128, method="sentence")]
    assert any(start < c < end for c in inside)  # the test can fail
    rows = _rows(smollm2_tokenizer, text, 128, [0])
    assert not [r.char_start for r in rows if start < r.char_start < end]
    assert start in {r.char_start for r in rows}


def test_text_lines_tells_fences_from_titles() -> None:
    md = "Intro:\n```py\nx = 1\n\ny = 2\n```\n~~~\ncode\n~~~\nA | B\n```\nnot closed\n"
    lines = text_lines(md)
    assert (
        lines.code == [False, True, True, True, True, True, True, True, True, False] + [False] * 2
    )
    assert lines.opens[1] and lines.opens[6] and lines.row[9]
    rst = "Title\n~~~~~\n\nText.\n\n~~~~~\nOther\n~~~~~\n\nMore.\n"
    assert not any(text_lines(rst).code)


def test_fingerprint_and_heading_offsets(smollm2_tokenizer) -> None:
    chunker = SectionChunker(512)
    assert chunker.fingerprint_fields()["section"]["v"] == SECTION_VERSION
    assert chunker.fingerprint == chunker_fingerprint("section", 512)
    assert chunker.fingerprint not in {chunker_fingerprint(m, 512) for m in ("fixed", "sentence")}
    text = "# A\n\n" + " ".join(map(_sentence, range(60)))
    # other chunkers ignore headings; a heading offset inside its line counts from the line
    assert _rows(smollm2_tokenizer, text, 64, [0], "fixed") == _rows(
        smollm2_tokenizer, text, 64, (), "fixed"
    )
    assert _rows(smollm2_tokenizer, text, 64, [2]) == _rows(smollm2_tokenizer, text, 64, [0])
    for bad in ([5, 3], [len(text) + 1], [-1]):
        with pytest.raises(ValueError, match="heading_starts must be ascending"):
            _rows(smollm2_tokenizer, text, 64, bad)


def test_chunk_stage_gives_each_document_its_headings(smollm2_tokenizer, tmp_path) -> None:
    from coinrag.schemas.tables import FileOrigin
    from coinrag.storage.store import Store
    from coinrag.tasks.chunk import chunk_stage
    from coinrag.tasks.ingest import SourceDocument

    store = Store.at(tmp_path / "store").init()
    text = "\n\n".join(
        f"# Part {i}\n\n" + " ".join(map(_sentence, range(i, i + 9))) for i in range(6)
    )
    heads = [m.start() for m in re.finditer("^# ", text, re.M)]
    origin = FileOrigin(
        path="a.md",
        heading_starts=heads,
        heading_levels=[1] * len(heads),
        heading_titles=[f"Part {i}" for i in range(len(heads))],
    )
    docs = [
        SourceDocument("a", text, {}, "a.md", origin),
        SourceDocument("b", text, {"v": 2}, "b.md"),
    ]

    def stage(run_id: str):
        return chunk_stage(
            store,
            docs,
            smollm2_tokenizer,
            tokenizer_fp="tok",
            chunk_size=160,
            method="section",
            run_id=run_id,
        )

    rows, n_new = stage("r1")
    a = [r for r in rows if r.doc_id == "a"]
    b = [r for r in rows if r.doc_id == "b"]
    assert n_new == len(rows) and all(r.text.startswith("# Part") for r in a)
    assert [r.text for r in b] != [r.text for r in a]  # "b" has no headings: cut elsewhere
    again, n_again = stage("r2")
    assert n_again == 0 and [r.chunk_id for r in again] == [r.chunk_id for r in rows]
