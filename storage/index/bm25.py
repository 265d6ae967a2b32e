"""A reader's in-memory BM25 copy of a table's ``text`` column (:class:`Bm25Index`), giving
the answers of LanceDB's full-text index (lancedb 0.40.0, lance 13.0.0, :data:`FTS_CONFIG`)
without its ~5 ms per query.

What lance does, read in its source (``lance-index/src/scalar/inverted/tokenizer.rs``
``InvertedIndexParams::build``, ``scorer.rs``; ``lance-tokenizer``, adapted from tantivy 0.24.2)
and checked against the library itself (``tests/storage/test_index_bm25.py``):

- tokens: maximal runs of ``char::is_alphanumeric`` characters (Unicode Alphabetic, or Nd, Nl,
  No), then, in this order: tokens of 40 bytes or more (UTF-8, before lower-casing) dropped;
  lower-cased character by character (no final sigma: ``ΣΑΣ`` becomes ``σασ``); stemmed
  (rust-stemmers English: Snowball's Porter2, here PyStemmer's); stop words dropped *after*
  stemming (NLTK's English list, so ``because``, whose stem is ``becaus``, stays); ASCII
  folding of tokens with a non-ASCII character, by lance-tokenizer's own rule (not tantivy's
  table): each non-ASCII character becomes its entry in a small table (:data:`FOLD`), else the
  ASCII characters and table entries of its NFKD decomposition (combining marks and other
  characters dropped), else stays itself;
- a document's length is its number of tokens left, and a row left with none is no document
  (it counts in neither N nor the average length); BM25 with k1 = 1.2, b = 0.75,
  ``idf = ln((N - n + 0.5) / (n + 0.5) + 1)``, N and the average length over the whole index,
  also under a prefilter (which only removes rows from the answer), all in float32; a term
  repeated in the query counts once per occurrence.
- Ties (exactly equal float32 scores) are broken here by row position; lance's WAND collector
  breaks them in its own walk order (neither by row address nor stable across k), so among
  tied rows the two may return different ones.

Text that cannot be tokenized the same way for sure (a character unassigned in this Python's
Unicode database: the two Unicode versions could disagree on it) makes the query, or the whole
copy, answer None: the caller asks LanceDB.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import numpy as np
import regex

from coinrag.storage.index.ann import FTS_CONFIG

K1 = np.float32(1.2)
B = np.float32(0.75)
# Lance sums a row's terms in float32 in its own order: the copy's scores are equal within a few
# float32 ulps (at most 1.7e-7 relative on the Python docs; this allows 8).
RTOL = 1e-6
MAX_TOKEN_BYTES = 40  # lance's default max_token_length: tokens of this many bytes are dropped
WORD = regex.compile(r"[\p{Alphabetic}\p{Nd}\p{Nl}\p{No}]+")
# NLTK's English stop words (the ``stop-words`` crate's ``get("en")``, lance-tokenizer 13.0.0),
# less those with an apostrophe (never one token here).
STOP_WORDS = frozenset(
    """i me my myself we our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves what which who whom
    this that these those am is are was were be been being have has had having do does did
    doing a an the and but if or because as until while of at by for with about against between
    into through during before after above below to from up down in out on off over under again
    further then once here there when where why how all any both each few more most other some
    such no nor not only own same so than too very s t can will just don should now d ll m o re
    ve y ain aren couldn didn doesn hadn hasn haven isn ma mightn mustn needn shan shouldn wasn
    weren won wouldn""".split()
)
# lance-tokenizer 13.0.0 ``src/ascii_folding_filter.rs`` ``fold_char``: letters NFKD does not
# decompose into ASCII.
FOLD = {
    "ß": "ss", "ẞ": "SS", "Æ": "AE", "æ": "ae", "Œ": "OE", "œ": "oe", "Ø": "O", "ø": "o",
    "Ł": "L", "ł": "l", "Đ": "D", "Ð": "D", "đ": "d", "ð": "d", "Þ": "TH", "þ": "th",
    "Ħ": "H", "ħ": "h", "Ŧ": "T", "ŧ": "t", "Ŋ": "N", "ŋ": "n", "ı": "i", "ĸ": "k", "ſ": "s",
}  # fmt: skip
# The full-text configuration this module reproduces (another one: LanceDB answers).
ANALYZED_CONFIG = {
    "with_position": False,
    "base_tokenizer": "simple",
    "language": "English",
    "lower_case": True,
    "stem": True,
    "remove_stop_words": True,
    "ascii_folding": True,
}


def fold_char(char: str) -> str:
    """One non-ASCII character, ASCII-folded as lance does (module docstring)."""
    if char in FOLD:
        return FOLD[char]
    kept = [
        d if d.isascii() else FOLD[d]
        for d in unicodedata.normalize("NFKD", char)
        if d.isascii() or d in FOLD
    ]
    return "".join(kept) or char


def ascii_fold(term: str) -> str:
    """A term ASCII-folded as lance does (unchanged if it is ASCII)."""
    return term if term.isascii() else "".join(c if c.isascii() else fold_char(c) for c in term)


class Analyzer:
    """LanceDB's English text analyzer (see the module docstring): text -> its terms."""

    def __init__(self) -> None:
        import Stemmer

        if FTS_CONFIG != ANALYZED_CONFIG:
            raise ValueError(
                f"FTS_CONFIG is {FTS_CONFIG}, but the in-memory BM25 copy reproduces only "
                f"{ANALYZED_CONFIG}: teach storage/index/bm25.py the new configuration"
            )
        self._stem = Stemmer.Stemmer("english").stemWord
        self._terms: dict[str, str | None] = {}

    def term(self, token: str) -> str | None:
        """The term of one raw token (a run of alphanumerics), None if it is dropped."""
        if token in self._terms:
            return self._terms[token]
        term: str | None = None
        if len(token.encode("utf-8")) < MAX_TOKEN_BYTES:
            lower = token.lower() if token.isascii() else "".join(c.lower() for c in token)
            stem = self._stem(lower)
            if stem not in STOP_WORDS:
                term = ascii_fold(stem)
        if len(self._terms) < 1_000_000:  # a cache: the corpus' words and some questions'
            self._terms[token] = term
        return term

    @staticmethod
    def certain(text: str) -> bool:
        """Whether ``text`` tokenizes here as in lance for sure: no character unassigned in
        this Python's Unicode database."""
        return text.isascii() or all(unicodedata.category(c) != "Cn" for c in set(text))

    def terms(self, text: str) -> list[str]:
        """The terms of ``text`` in order, repeats kept."""
        found = (self.term(t) for t in WORD.findall(text))
        return [t for t in found if t is not None]


class Bm25Index:
    """An inverted index of ``n`` texts (rows in table order), scored as lance does.

    Holds per term its postings (row positions ascending, int32) and their float32 document
    weights ``(k1 + 1) tf / (tf + k1 (1 - b + b dl / avgdl))``; a query sums ``idf * weight``
    over its terms. Building it for the 142,565 nuggets of the Python docs takes a few
    seconds (see ``tests/storage/test_index_bm25.py``)."""

    def __init__(self, texts: Sequence[str | None], analyzer: Analyzer | None = None) -> None:
        self.analyzer = analyzer or Analyzer()
        self.n = len(texts)
        self.exact = all(self.analyzer.certain(t) for t in texts if t)
        ids: dict[str, int] = {}
        token_terms: list[int] = []
        lengths = np.zeros(self.n, dtype=np.int64)
        for row, text in enumerate(texts):
            terms = self.analyzer.terms(text) if text else []
            lengths[row] = len(terms)
            token_terms.extend(ids.setdefault(t, len(ids)) for t in terms)
        self.term_ids = ids
        docs = np.repeat(np.arange(self.n, dtype=np.int64), lengths)
        keys, tf = np.unique(np.asarray(token_terms, np.int64) * self.n + docs, return_counts=True)
        term_of, self.post_docs = np.divmod(keys, max(self.n, 1))
        self.post_docs = self.post_docs.astype(np.int32)
        self.starts = np.searchsorted(term_of, np.arange(len(ids) + 1)).astype(np.int64)
        df = np.diff(self.starts).astype(np.float32)
        num_docs = np.float32(np.count_nonzero(lengths))  # a row with no term is not a document
        avgdl = np.float32(lengths.sum()) / num_docs if num_docs else np.float32(1.0)
        half = np.float32(0.5)
        self.idf = np.log((num_docs - df + half) / (df + half) + np.float32(1.0))
        dl = lengths.astype(np.float32)
        norm = K1 * (np.float32(1.0) - B + B * dl / avgdl)
        tf32 = tf.astype(np.float32)
        self.weights = (K1 + np.float32(1.0)) * tf32 / (tf32 + norm[self.post_docs])

    @property
    def nbytes(self) -> int:
        return int(self.post_docs.nbytes + self.weights.nbytes + self.starts.nbytes)

    def search(
        self, text: str, k: int, positions: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The best ``k`` rows for ``text``: ``(positions (m,) int64, scores (m,) float32)``,
        best first, ``m <= k`` (rows matching no term are left out); ``positions``: only
        these rows (ascending). None if the answer could differ from lance's (module
        docstring): the caller asks LanceDB."""
        if not self.exact or not self.analyzer.certain(text):
            return None
        empty = np.empty(0, np.int64), np.empty(0, np.float32)
        query = [self.term_ids.get(t) for t in self.analyzer.terms(text)]
        query = [t for t in query if t is not None]
        if not query or k <= 0:
            return empty
        scores = np.zeros(self.n, dtype=np.float32)
        hit = np.zeros(self.n, dtype=bool)
        for t in query:  # in query order: lance sums each term's part in float32 too
            a, b = self.starts[t], self.starts[t + 1]
            docs = self.post_docs[a:b]
            scores[docs] += self.idf[t] * self.weights[a:b]
            hit[docs] = True
        rows = np.flatnonzero(hit) if positions is None else positions[hit[positions]]
        return _top(rows, scores[rows], k) if len(rows) else empty


def _top(rows: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best of ``rows`` (ascending) by score, ties by row, best first."""
    if len(rows) > k:
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        keep = scores >= kth
        rows, scores = rows[keep], scores[keep]
    order = np.argsort(-scores, kind="stable")[:k]
    return rows[order].astype(np.int64), scores[order]


def same_answers(lance: Sequence[tuple[str, float]], mine: Sequence[tuple[str, float]]) -> bool:
    """Whether two top-k answers (``(id, score)``, best first) are equal within float32
    rounding: the same scores within :data:`RTOL`, every id in both with its score, but for
    rows scoring as the last one (a tie at the cut, which lance breaks in its own order)."""
    if len(lance) != len(mine):
        return False
    for (_, a), (_, b) in zip(lance, mine, strict=True):
        if abs(a - b) > RTOL * abs(a):
            return False
    for one, other in ((lance, dict(mine)), (mine, dict(lance))):
        last = one[-1][1] if one else 0.0
        for row, score in one:
            found = other.get(row)
            near = last if found is None else found
            if abs(score - near) > RTOL * abs(score):
                return False
    return True
