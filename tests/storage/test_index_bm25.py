"""The reader's in-memory BM25 copy (``storage/index/bm25.py``) held to LanceDB's own full-text
index (lancedb 0.40.0, :data:`FTS_CONFIG`) on real tables in a temp dir: the same rows and
scores within float32 rounding (``RTOL`` = 1e-6 relative, ``same_answers``), unfiltered and
under an ``IN`` prefilter, for several k, on generated text and on the Python docs' pages.

Ties: rows of exactly equal score are ordered by row in the copy, in lance's own walk order by
lance (which is not even a stable prefix across k: see
``test_lance_breaks_ties_in_its_own_order``), so ``same_answers`` lets the rows tied at the cut
differ and compares everything else."""

from __future__ import annotations

import random
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pytest
from lancedb.index import FTS
from lancedb.query import MatchQuery

from coinrag.storage.index.ann import FTS_COLUMN, FTS_CONFIG
from coinrag.storage.index.bm25 import (
    RTOL,
    STOP_WORDS,
    WORD,
    Analyzer,
    Bm25Index,
    same_answers,
)

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
WORDS = (
    "run running runs ran runner apple apples banana bananas cherry python pythonic parse "
    "parser parsing generously generous connection connections café CAFÉ naïve façade ŒUVRE "
    "straße STRASSE Ⅸ ix ﬁnance finance brûlée Ĳssel x86 3 11 64 v2 os_path the of and is "
    "because very why being having don just"
).split()
LONG = ["a" * 38 + "b", "c" * 39 + "d", "e" * 40 + "f", "é" * 19 + "g", "é" * 20 + "h"]


def _table(tmp_path: Path, texts: list[str | None]) -> tuple[object, list[str]]:
    ids = [f"r{i:05d}" for i in range(len(texts))]
    db = lancedb.connect(tmp_path / "db")
    tbl = db.create_table("t", pa.table({"id": ids, FTS_COLUMN: texts}))
    tbl.create_index(FTS_COLUMN, config=FTS(**FTS_CONFIG))
    return tbl, ids


def _lance(tbl, text: str, k: int, where: list[str] | None = None) -> list[tuple[str, float]]:
    query = tbl.search(MatchQuery(text, FTS_COLUMN), query_type="fts").select(["id", "_score"])
    if where is not None:
        query = query.where("id IN (" + ", ".join(f"'{i}'" for i in where) + ")", prefilter=True)
    got = query.limit(k).to_arrow()
    return list(zip(got.column("id").to_pylist(), got.column("_score").to_pylist(), strict=True))


def _copy(index: Bm25Index, ids: list[str], text: str, k: int, positions=None):
    found = index.search(text, k, positions)
    assert found is not None
    return [(ids[p], float(s)) for p, s in zip(*found, strict=True)]


def _check(tbl, ids, index, queries, ks, subsets) -> int:
    """Every query, k and prefilter (None: all rows): the copy's answer is lance's; returns
    how many were identical to the last bit and order."""
    identical = 0
    for text in queries:
        for k in ks:
            for subset in [None, *subsets]:
                positions = None if subset is None else np.array(sorted(subset))
                where = None if subset is None else [ids[p] for p in sorted(subset)]
                want = _lance(tbl, text, k, where)
                got = _copy(index, ids, text, k, positions)
                assert same_answers(want, got), (text, k, subset is not None, want, got)
                identical += want == got
    return identical


def test_generated_text_equals_lancedb(tmp_path):
    rng = random.Random(23)
    vocab = WORDS + LONG + [f"w{i}" for i in range(40)]
    texts = [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 25)))
        + rng.choice(["", ".", "!", " -- ", ", (x)"])
        for _ in range(300)
    ]
    texts += ["", "the of and", "!!!", LONG[2], "apple " * 30, "Apple, apple; APPLE!", None]
    tbl, ids = _table(tmp_path, texts)
    index = Bm25Index(texts)
    assert index.exact
    queries = [
        "apple",
        "apple apple banana",
        "Running parsers generously",
        "CAFE naive facade oeuvre",
        "strasse STRASSE straße",
        "finance ﬁnance IX Ⅸ",
        "x86-64 3.11 v2 os_path",
        LONG[0] + " " + LONG[1],
        "w1 w2 w3 w4 w5 w6 w7 w8",
    ] + [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 8))) for _ in range(15)]
    subsets = [rng.sample(range(len(texts)), 40), [len(texts) - 2]]
    identical = _check(tbl, ids, index, queries, (1, 3, 10, 50), subsets)
    assert identical > 0
    for text in ("the of and is", "", "!!!", LONG[2], "nosuchword"):
        assert _lance(tbl, text, 5) == [] and _copy(index, ids, text, 5) == []


@pytest.mark.skipif(not DOCS.is_dir(), reason="needs Debian's python3.11-doc")
def test_python_docs_pages_equal_lancedb(tmp_path):
    pages = sorted(DOCS.glob("faq/*.rst.txt")) + [DOCS / "howto/unicode.rst.txt"]
    texts = [
        para.strip()
        for page in pages
        for para in page.read_text(encoding="utf-8").split("\n\n")
        if para.strip()
    ]
    assert len(texts) > 1000
    tbl, ids = _table(tmp_path, texts)
    index = Bm25Index(texts)
    assert index.exact
    rng = random.Random(5)
    queries = [
        "Why does Python use indentation for grouping of statements?",
        "How do I convert a string to a number?",
        "What is the difference between a tuple and a list?",
        "Why can't raw strings (r-strings) end with a backslash?",
        "How do I encode Unicode text as UTF-8 bytes?",
        "naïve café résumé normalization NFKD",
    ] + [" ".join(texts[i].split()[:12]) for i in rng.sample(range(len(texts)), 12)]
    subsets = [rng.sample(range(len(texts)), 200)]
    assert _check(tbl, ids, index, queries, (3, 10), subsets) > 0


def test_lance_breaks_ties_in_its_own_order(tmp_path):
    """Rows 0 and 1 hold one text, so they score the same: for k = 3 lance returns row 1 (its
    walk order, lancedb 0.40.0), the copy row 0 (table order); both are right answers."""
    texts = ["dup word", "dup word", "dup dup word x", "other", "other", "other", "dup"]
    tbl, ids = _table(tmp_path, texts)
    index = Bm25Index(texts)
    lance, copy = _lance(tbl, "dup", 3), _copy(index, ids, "dup", 3)
    assert [i for i, _ in lance] == ["r00006", "r00002", "r00001"]
    assert [i for i, _ in copy] == ["r00006", "r00002", "r00000"]
    assert same_answers(lance, copy)
    assert [i for i, _ in _copy(index, ids, "dup", 4)] == ["r00006", "r00002", "r00000", "r00001"]


def _classes_agree(tmp_path: Path, tokens: list[str]) -> list[str]:
    """One row per raw token: for each term of the copy, LanceDB's hits for one of its tokens
    must be exactly the rows of that term, and a token the copy drops must find nothing.
    Returns the disagreements."""
    tbl, ids = _table(tmp_path, tokens)
    analyzer = Analyzer()
    rows_of: dict[str | None, list[int]] = {}
    for i, token in enumerate(tokens):
        rows_of.setdefault(analyzer.term(token), []).append(i)
    bad = []
    for term, rows in rows_of.items():
        probes = rows if term is None else rows[:1]
        for i in probes:
            found = {j for j, _ in _lance(tbl, tokens[i], len(rows) + 5)}
            want = set() if term is None else {ids[j] for j in rows}
            if found != want:
                bad.append(f"{tokens[i]!r}: copy {term!r} {sorted(want)}, lance {sorted(found)}")
    return bad


@pytest.mark.heavy
def test_every_letter_and_digit_is_analyzed_as_lancedb_does(tmp_path):
    """Every alphanumeric character of U+00A0-U+2FFF and of the ligature, full-width,
    mathematical and enclosed blocks, as the token ``q`` + it (about 8,400 tokens, 6,300
    terms): lower-casing, stemming and ASCII folding give lance's classes (about 20 s)."""
    import unicodedata

    ranges = [(0xA0, 0x3000), (0xFB00, 0xFB50), (0xFF00, 0xFFF0), (0x1D400, 0x1D800)]
    ranges.append((0x1F100, 0x1F200))
    tokens = {"q" + s for s in ("ss", "ae", "oe", "o", "l", "d", "th", "h", "t", "n", "i")}
    for a, b in ranges:
        for cp in range(a, b):
            token = "q" + chr(cp)
            if unicodedata.category(chr(cp)) != "Cn" and WORD.fullmatch(token):
                tokens.add(token)
    assert len(tokens) > 8000
    assert _classes_agree(tmp_path, sorted(tokens)) == []


@pytest.mark.heavy
@pytest.mark.skipif(not DOCS.is_dir(), reason="needs Debian's python3.11-doc")
def test_the_words_of_python_docs_pages_are_analyzed_as_lancedb_does(tmp_path):
    """Every distinct word of the FAQ, the tutorial and the how-tos (about 9,900: stems,
    stop words, long tokens) falls in lance's class (about 40 s)."""
    words: set[str] = set()
    for folder in ("faq", "tutorial", "howto"):
        for page in (DOCS / folder).glob("*.rst.txt"):
            words.update(WORD.findall(page.read_text(encoding="utf-8")))
    assert len(words) > 5000
    assert _classes_agree(tmp_path, sorted(words)) == []


def test_the_analyzer_follows_lances_order_of_filters():
    analyzer = Analyzer()
    # stemmed before the stop words are dropped: "being" -> "be" (a stop word) goes,
    # "because" -> "becaus" (not one) stays
    assert analyzer.terms("being because very the") == ["becaus", "veri"]
    # long tokens go by their UTF-8 bytes before lower-casing; folding after stemming
    assert analyzer.terms(LONG[0] + " " + LONG[1] + " " + LONG[3] + " " + LONG[4]) == [
        LONG[0],
        "e" * 19 + "g",
    ]
    assert analyzer.terms("Café ŒUVRE straße Ⅸ x½") == ["cafe", "oeuvr", "strasse", "ix", "x12"]
    assert analyzer.terms("x86-64 os_path") == ["x86", "64", "os", "path"]
    assert analyzer.terms("ΣΑΣ σας") == ["σασ", "σας"]  # lower-cased per character
    assert {"the", "s", "t", "don", "wouldn"} <= STOP_WORDS and "would" not in STOP_WORDS


def test_text_it_cannot_tokenize_for_sure_is_left_to_lancedb():
    """A character unassigned in this Python's Unicode database: the copy answers None."""
    unassigned = chr(0x1FAE9)  # assigned after Unicode 14 (Python 3.11's database)
    assert not Analyzer.certain("x" + unassigned)
    index = Bm25Index(["apple pie", "banana"])
    assert index.search("apple " + unassigned, 3) is None
    assert index.search("apple", 3) is not None
    assert Bm25Index(["apple " + unassigned, "banana"]).search("apple", 3) is None


def test_same_answers_allows_float32_rounding_and_cut_ties_only():
    a = [("x", 2.0), ("y", 1.0), ("z", 1.0)]
    assert same_answers(a, [("x", 2.0 * (1 + RTOL / 2)), ("z", 1.0), ("y", 1.0)])
    assert same_answers(a, [("x", 2.0), ("y", 1.0), ("w", 1.0)])  # a tie at the cut
    assert not same_answers(a, [("x", 2.0 * (1 + 2 * RTOL)), ("y", 1.0), ("z", 1.0)])
    assert not same_answers(a, [("w", 2.0), ("y", 1.0), ("z", 1.0)])
    assert not same_answers(a, a[:2])
