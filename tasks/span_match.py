"""Span matching of nugget recovery: map an LLM's "verbatim" candidate back to exact offsets inside
a chunk (pure; the recover stage, ``tasks/recover.py``, applies it to the store).

CoinRAG step 3. Candidates are processed in the given order; each one is either recovered to a
token-aligned span of the chunk (:class:`RecoveredSpan`) or abandoned (:class:`AbandonedCandidate`):

1. **Abandon early**: empty or whitespace (``"empty"``); no alphanumeric character
   (``"no_word"``); stripped candidate longer than the chunk text (``"too_long"``).
2. **Exact**: the stripped candidate occurs verbatim in the raw chunk text on word boundaries (a
   hit must not split a run of word characters, i.e. letters, digits, ``_`` and combining marks:
   ``area`` inside ``areas`` is no hit). ``match_kind="exact"``, ``similarity=1.0``.
3. **Normalised exact**: the canonical candidate (:func:`canonical_form`, below) occurs in the
   canonical chunk on word boundaries; a map from canonical positions back to original characters
   gives the source offsets. ``match_kind="fuzzy"``, ``similarity=1.0``: the texts differ only in
   formatting (case, quotes, dashes, spacing, digit grouping).
4. **Fuzzy**: the canonical chunk is split into words at spaces (whole words, punctuation stays
   attached). With ``n`` words in the canonical candidate and ``d = max(1, round(n / 5))``, every
   window of ``L`` consecutive words, ``max(1, n - d) <= L <= n + d``, is scored with the Indel
   similarity on canonical text, ``sim = 1 - indel / (len(a) + len(b))`` where
   ``indel = len(a) + len(b) - 2 * LCS(a, b)`` (this is ``rapidfuzz.fuzz.ratio / 100``).
   If no window fits (``n - d`` words exceed the chunk's) the candidate is ``"too_long"``. The
   best window ``s* = argmax sim`` is accepted when ``sim >= tau`` (``match_kind="fuzzy"``), else
   the candidate is abandoned as ``"below_threshold"`` with that exact best similarity. An
   accepted window then loses the punctuation at its edges that the candidate lacks
   (:func:`trim_edge_punctuation`: ``"... Hungarian composer"`` recovers ``"... Hungarian
   composer"``, not the window's ``"composer,"``; ``"(Irish: ...)"`` keeps its brackets only when
   the candidate has them). Only the span shrinks: which window wins, its similarity and the
   decision to accept are those of the whole-word window.

Canonical form, per original character (:func:`fold_char`), then over the sequence:

* whitespace becomes a space and runs of spaces collapse to one;
* single quotes (``’ ‘ ′ ` ´`` ...) become ``'``, double quotes and guillemets (``“ ” „ « »``)
  become ``"``, hyphens and dashes (``‐ ‑ ‒ – — ― −``) become ``-``; format characters (soft
  hyphen, zero-width space) are dropped;
* NFKD compatibility decomposition and case folding (``"ß" -> "ss"``, ``"ﬁ" -> "fi"``). Accents
  stay as separate combining marks, so ``Gráinne`` vs ``Grainne`` costs one edit (an insertion)
  where a substituted letter costs two: a dropped accent lowers the similarity a little, pure
  formatting not at all. Stroked letters (``ø đ ł ħ ŧ``) decompose the same way;
* a digit-group separator (``,``, ``_``, thin or narrow no-break space) between an ASCII digit and
  exactly three ASCII digits is dropped: ``299,792,458`` and ``299792458`` agree.

The paper's example, candidate ``"Grace O'Malley (Irish: Grainne Ni Mhaille)"`` in
``"… Grace O’Malley (Irish: Gráinne Ní Mháille) was …"``, is recovered as ``"fuzzy"`` to the source
window at ``1 - 3/87 = 0.9655`` (three dropped accents; the paper's own measure gave 0.953).

Ambiguity: a cursor starts at 0 and moves to the ``char_start`` of every accepted span. When
several places match equally well, the first one starting at or after the cursor wins, else the
first one overall; among fuzzy windows with the same similarity and start, the word count closest
to ``n`` wins, then the shorter. ``occurrences`` counts the matching places (for fuzzy: distinct
start words among the best windows); > 1 means ambiguous.

Snapping: the char span ``[cs, ce)`` becomes the range of every token whose span intersects it
(:func:`char_span_to_token_span`); ``char_start``/``char_end`` are the start of its first and the
end of its last token and ``text = chunk_text[char_start:char_end]``, the *source* text, never the
candidate. With byte-level BPE tokenizers (GPT-2, SmolLM2) the text therefore often starts with
the first token's leading space, and ``tokenizer.decode(token_ids[tok_start:tok_end]) == text``
exactly. Punctuation the candidate lacks is in the text only where a tokenizer glues it to a
word's token (SmolLM2 splits ``","`` and ``"."`` into tokens of their own: they stay out). A
token of punctuation only that the span reaches into, and that brings punctuation the candidate
lacks at that end, is left out (:func:`shed_edge_tokens`): SmolLM2 reads ``"(1368–1644)."`` as
``... "4", ")."``, and the candidate ``"built by the Ming dynasty (1368-1644)"`` recovers
``" built by the Ming dynasty (1368–1644"``, not ``"... (1368–1644)."``: the candidate's own
``")"`` goes with the ``"."`` it lacks, since a nugget is whole tokens.

Duplicates are kept: candidates landing on the same span give several ``RecoveredSpan`` (the
caller dedupes by token span).

Speed: all chunk structures (canonical text and map, word offsets, window and block texts) are
built at most once per chunk, lazily; the exact stages cost two ``str.find`` scans. The fuzzy
stage returns exactly what scoring every window would (``tests/recover_reference.py`` does that)
but prunes with upper bounds from ``LCS(c, w) <= LCS(c, t)`` for any text ``t`` containing window
``w``: blocks of window starts are bounded in one rapidfuzz call and scored best bound first, and
when no block stands out (typical of junk) the longest windows are scored first and bound the
shorter windows inside them. Nothing whose bound reaches the best similarity is skipped.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Indel, LCSseq

__all__ = [
    "AbandonedCandidate",
    "RecoveredSpan",
    "canonical_form",
    "char_span_to_token_span",
    "fold_char",
    "recover_candidates",
    "shed_edge_tokens",
    "trim_edge_punctuation",
    "window_word_range",
]

EXACT = "exact"
FUZZY = "fuzzy"
REASON_EMPTY = "empty"
REASON_NO_WORD = "no_word"
REASON_TOO_LONG = "too_long"
REASON_BELOW = "below_threshold"
DEFAULT_TAU = 0.7


@dataclass(frozen=True)
class RecoveredSpan:
    """A candidate mapped onto the chunk; ``text`` is the source text, never the candidate."""

    candidate: str  # what the LLM proposed
    text: str  # chunk_text[char_start:char_end]
    match_kind: str  # "exact" | "fuzzy"
    similarity: float  # 1.0 for exact; Indel similarity on canonical text for fuzzy
    char_start: int  # [s, e) into chunk_text, snapped to token boundaries
    char_end: int
    tok_start: int  # [s, e) token indices into the chunk's tokens
    tok_end: int
    occurrences: int  # how many places matched (> 1 means ambiguous)


_new = object.__new__
_set = object.__setattr__


def _span(
    candidate: str, text: str, kind: str, sim: float, cs: int, ce: int, ts: int, te: int, occ: int
) -> RecoveredSpan:
    """``RecoveredSpan(...)`` without the frozen ``__init__`` (nine ``object.__setattr__``
    calls, the largest cost of an exact hit); the object is the same."""
    span = _new(RecoveredSpan)
    _set(
        span,
        "__dict__",
        {
            "candidate": candidate,
            "text": text,
            "match_kind": kind,
            "similarity": sim,
            "char_start": cs,
            "char_end": ce,
            "tok_start": ts,
            "tok_end": te,
            "occurrences": occ,
        },
    )
    return span


@dataclass(frozen=True)
class AbandonedCandidate:
    """A candidate that could not be recovered."""

    candidate: str
    best_similarity: float  # best window similarity (0.0 when no window was scored)
    reason: str  # "empty" | "no_word" | "too_long" | "below_threshold"


# ---------------------------------------------------------------------------- canonical form

SINGLE_QUOTES = "'‘’‚‛′‵`´ʹʻʼʽ＇"
DOUBLE_QUOTES = '"“”„‟″‶«»＂'
DASHES = "-‐‑‒–—―−⁃﹘﹣－"
DIGIT_SEPARATORS = ",_\u2009\u202f"
_STROKES = {"ø": "o\u0338", "đ": "d\u0335", "ł": "l\u0337", "ħ": "h\u0335", "ŧ": "t\u0335"}

_PRE: dict[str, str] = {}
_PRE.update(dict.fromkeys(SINGLE_QUOTES, "'"))
_PRE.update(dict.fromkeys(DOUBLE_QUOTES, '"'))
_PRE.update(dict.fromkeys(DASHES, "-"))
_PRE.update(_STROKES)
_PRE["ı"] = "i"


@lru_cache(maxsize=65536)
def fold_char(ch: str) -> str:
    """Canonical form of one character (before spaces collapse and digit separators drop).

    >>> [fold_char(c) for c in "A’–\\u00ad\\t"], fold_char("é") == "e\\u0301"
    (['a', "'", '-', '', ' '], True)
    """
    if ch.isspace():
        return " "
    pre = _PRE.get(ch)
    if pre is not None:
        return pre
    if unicodedata.category(ch) == "Cf":
        return ""
    folded = unicodedata.normalize("NFKD", ch).casefold()
    if len(folded) == 1 and folded not in _PRE and not folded.isspace():
        return folded
    return "".join(_PRE.get(u, u) for u in folded if not u.isspace())


class _FoldTable(dict):
    """``str.translate`` table ``ord(ch) -> fold_char(ch)``, filled on first use."""

    def __missing__(self, key: int) -> str:
        value = fold_char(chr(key))
        self[key] = value
        return value


_FOLD = _FoldTable()
_ASCII_LUT = np.array([ord(fold_char(chr(i))) for i in range(128)], dtype=np.uint8)
# a digit, then a separator followed by exactly three digits (the separator is group 1's end)
_SEP_RE = re.compile(r"([0-9])[,_\u2009\u202f](?=[0-9]{3}(?![0-9]))")
_HAS_ALNUM_RE = re.compile(r"[^\W_]")
_SPACE = ord(" ")


def _canonicalize(text: str) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """Canonical text (not stripped); per canonical character, its original index; and the
    canonical start and end of every word (run of non-space characters)."""
    n = len(text)
    counts = None  # characters each original character becomes (None: all 1)
    expansions: list[tuple[int, str]] = []
    if text.isascii():
        out = _ASCII_LUT[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
    else:
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        out = cps.copy()
        small = cps < 128
        out[small] = _ASCII_LUT[cps[small]]
        for k in np.flatnonzero(~small).tolist():
            f = _FOLD[int(cps[k])]
            if len(f) == 1:
                out[k] = ord(f)
            else:
                if counts is None:
                    counts = np.ones(n, dtype=np.int64)
                counts[k] = len(f)
                if f:
                    expansions.append((k, f))
    if "," in text or "_" in text or "\u2009" in text or "\u202f" in text:
        for m in _SEP_RE.finditer(text):
            if counts is None:
                counts = np.ones(n, dtype=np.int64)
            counts[m.end(1)] = 0
    if counts is None:
        orig = np.arange(n)
    else:
        orig = np.repeat(np.arange(n), counts)
        pos = np.cumsum(counts) - counts
        out = np.repeat(out, counts)
        for k, f in expansions:
            out[pos[k] : pos[k] + len(f)] = [ord(u) for u in f]
    space = out == _SPACE
    dup = space[1:] & space[:-1]
    if dup.any():
        keep = np.ones(len(out), dtype=bool)
        keep[1:] = ~dup
        out = out[keep]
        orig = orig[keep]
        space = space[keep]
    word = np.zeros(len(out) + 2, dtype=bool)
    np.logical_not(space, out=word[1:-1])
    edges = np.flatnonzero(word[1:] != word[:-1])
    if out.dtype == np.uint8:
        canon = out.tobytes().decode("ascii")
    else:
        canon = out.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
    return canon, orig, edges[0::2], edges[1::2]


def canonical_form(text: str) -> str:
    """The canonical form used for matching, stripped of leading and trailing spaces.

    >>> canonical_form("  Grace O’Malley  —  299,792,458 m/s ")
    "grace o'malley - 299792458 m/s"
    >>> canonical_form("Gráinne") == "gra\\u0301inne"
    True
    """
    if "," in text or "_" in text or "\u2009" in text or "\u202f" in text:
        text = _SEP_RE.sub(r"\1", text)
    return " ".join(text.translate(_FOLD).split())


def window_word_range(n_words: int) -> tuple[int, int]:
    """Allowed window sizes ``(lo, hi)`` (inclusive) for a candidate of ``n_words`` words.

    ``d = max(1, round(n / 5))`` (n/5 never ends in .5), ``lo = max(1, n - d)``, ``hi = n + d``.

    >>> window_word_range(12), window_word_range(3), window_word_range(13)
    ((10, 14), (2, 4), (10, 16))
    """
    d = max(1, (n_words + 2) // 5)
    return max(1, n_words - d), n_words + d


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_" or (ch > "\x7f" and unicodedata.category(ch)[0] == "M")


def _on_boundaries(s: str, a: int, b: int) -> bool:
    """True when ``s[a:b]`` splits no run of word characters."""
    if 0 < a < len(s) and _is_word_char(s[a - 1]) and _is_word_char(s[a]):
        return False
    return not (0 < b < len(s) and _is_word_char(s[b - 1]) and _is_word_char(s[b]))


def _find_all(hay: str, needle: str) -> list[int]:
    """Starts of every (possibly overlapping) occurrence of ``needle`` on word boundaries."""
    m = len(needle)
    hits = []
    k = hay.find(needle)
    while k >= 0:
        if _on_boundaries(hay, k, k + m):
            hits.append(k)
        k = hay.find(needle, k + 1)
    return hits


def _edge_runs(c: str) -> tuple[str, str]:
    """The leading and trailing runs of non-word characters of ``c``.

    >>> _edge_runs('"rebel" legend,'), _edge_runs("composer")
    (('"', ','), ('', ''))
    """
    x = 0
    while x < len(c) and not _is_word_char(c[x]):
        x += 1
    y = len(c)
    while y > x and not _is_word_char(c[y - 1]):
        y -= 1
    return c[:x], c[y:]


def trim_edge_punctuation(canon: str, a: int, b: int, c: str) -> tuple[int, int]:
    """The window ``canon[a:b]`` without the edge characters the candidate ``c`` lacks.

    Windows are whole words, so a window ending in ``"composer,"`` carries the comma although
    the candidate ``"... Hungarian composer"`` never had one. From each end, non-word characters
    (punctuation, spaces) are dropped while they do not occur in the candidate's own run of
    non-word characters at that end; the first word character, or one the candidate has there,
    stops it. A window that would lose everything is kept whole. Both texts are canonical.

    >>> w = "(ming rule)."
    >>> w[slice(*trim_edge_punctuation(w, 0, len(w), "ming rule"))]
    'ming rule'
    >>> w[slice(*trim_edge_punctuation(w, 0, len(w), "(ming rule."))]
    '(ming rule).'
    """
    lead, trail = _edge_runs(c)
    x, y = a, b
    while x < y and canon[x] not in lead and not _is_word_char(canon[x]):
        x += 1
    while y > x and canon[y - 1] not in trail and not _is_word_char(canon[y - 1]):
        y -= 1
    return (x, y) if x < y else (a, b)


# ---------------------------------------------------------------------------- token snapping


def _lacks(chars: str, run: str) -> bool:
    """Whether ``chars`` (source text) hold punctuation not in ``run`` (a candidate's edge run,
    canonical): spaces do not count."""
    return any(u != " " and u not in run for ch in chars for u in fold_char(ch))


def _punctuation_only(text: str) -> bool:
    return not any(_is_word_char(ch) for ch in text)


def shed_edge_tokens(
    text: str, token_spans: Sequence[tuple[int, int]], ts: int, te: int, cs: int, ce: int, c: str
) -> tuple[int, int]:
    """The token range ``[ts, te)`` covering the char span ``[cs, ce)`` of ``text`` without its
    edge tokens that reach beyond the span with punctuation the candidate ``c`` (canonical)
    lacks at that end and hold no word character: such a token (``").")`` glued by the
    tokenizer) would bring that punctuation into the nugget. At least one token stays.

    >>> text = "(1368–1644). It"
    >>> spans = [(0, 1), (1, 5), (5, 6), (6, 10), (10, 12), (12, 15)]
    >>> shed_edge_tokens(text, spans, 0, 5, 0, 11, "(1368-1644)")
    (0, 4)
    >>> shed_edge_tokens(text, spans, 0, 5, 0, 12, "(1368-1644).")
    (0, 5)
    """
    lead, trail = _edge_runs(c)
    while te - ts > 1:
        s, e = token_spans[te - 1]
        if e > ce and _lacks(text[ce:e], trail) and _punctuation_only(text[s:e]):
            te -= 1
        else:
            break
    while te - ts > 1:
        s, e = token_spans[ts]
        if s < cs and _lacks(text[s:cs], lead) and _punctuation_only(text[s:e]):
            ts += 1
        else:
            break
    return ts, te


_START = itemgetter(0)
_END = itemgetter(1)


def char_span_to_token_span(
    token_spans: Sequence[tuple[int, int]], cs: int, ce: int
) -> tuple[int, int]:
    """Smallest token range ``[ts, te)`` covering the char span ``[cs, ce)``.

    It holds every token whose span intersects ``[cs, ce)`` (so the tokens of a multi-byte
    character that share one span are kept together). Spans must be sorted (starts and ends
    non-decreasing), as a fast tokenizer's offset mapping is. Raises ``ValueError`` when
    ``cs >= ce`` or no token intersects the span.

    >>> spans = [(0, 5), (5, 11), (11, 12), (11, 12), (12, 18)]  # "Grace O’Malley" style
    >>> char_span_to_token_span(spans, 6, 11), char_span_to_token_span(spans, 7, 12)
    ((1, 2), (1, 4))
    """
    ts = bisect_right(token_spans, cs, key=_END)
    te = bisect_left(token_spans, ce, key=_START)
    if cs >= ce or ts >= te:
        raise ValueError(f"char span [{cs}, {ce}) is empty or covered by no token")
    return ts, te


# ---------------------------------------------------------------------------- per-chunk index

_BLOCK = 8  # window starts per block of the fuzzy search
_MAX_BLOCKS = 4  # more surviving blocks than this: score their whole range at once
_CLOSE = 0.05  # bounds this close to the top one: the block bounds do not discriminate
_EPS = 1e-12


class _Chunk:
    """Everything about one chunk that does not depend on the candidate (built lazily)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._canon: tuple[str, np.ndarray] | None = None
        self._words: tuple[list[int], list[int], np.ndarray, np.ndarray] | None = None
        self._windows: dict[int, list[str]] = {}
        self._blocks: dict[int, list[str]] = {}

    def _build(self) -> None:
        canon, orig, ws_a, we_a = _canonicalize(self.text)
        self._canon = (canon, orig)
        self._words = (ws_a.tolist(), we_a.tolist(), ws_a, we_a)

    @property
    def canon(self) -> tuple[str, np.ndarray]:
        """Canonical text and the original index of each of its characters."""
        if self._canon is None:
            self._build()
        return self._canon

    @property
    def words(self) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        """Canonical word starts and ends (lists and numpy arrays)."""
        if self._words is None:
            self._build()
        return self._words

    def windows(self, size: int) -> list[str]:
        """All windows of ``size`` consecutive words, by start word."""
        got = self._windows.get(size)
        if got is None:
            canon = self.canon[0]
            ws, we, _, _ = self.words
            got = [canon[a:b] for a, b in zip(ws, we[size - 1 :], strict=False)]
            self._windows[size] = got
        return got

    def blocks(self, hi: int) -> list[str]:
        """Block texts: block k covers every window of <= ``hi`` words starting in it."""
        got = self._blocks.get(hi)
        if got is None:
            canon = self.canon[0]
            _, _, ws_a, we_a = self.words
            first = ws_a[::_BLOCK]
            last = np.minimum(len(ws_a), np.arange(0, len(ws_a), _BLOCK) + (_BLOCK - 1 + hi)) - 1
            got = [canon[a:b] for a, b in zip(first.tolist(), we_a[last].tolist(), strict=True)]
            self._blocks[hi] = got
        return got


def _fuzzy_search(
    ch: _Chunk, c: str, n: int, lo: int, hi: int
) -> tuple[float, set[tuple[int, int]]]:
    """Best similarity over all windows of lo..hi words, and every window ``(i, L)`` reaching it.

    Exact (the same result as scoring every window), but prunes with two upper bounds on the
    LCS of a window ``w``: ``LCS(c, w) <= LCS(c, t)`` for any text ``t`` containing ``w``, and
    ``LCS <= min(len(c), len(w))``; with the Indel similarity ``2 LCS / (len(c) + len(w))``.
    """
    canon = ch.canon[0]
    ws, we, ws_a, we_a = ch.words
    n_w = len(ws)
    hi = min(hi, n_w)
    la = len(c)
    n_starts = n_w - lo + 1
    best = -1.0
    ties: set[tuple[int, int]] = set()

    def take(sims: np.ndarray, starts: Sequence[int], sizes: Sequence[int] | int) -> None:
        """Merge windows ``(starts[j], sizes[j])`` with similarities ``sims`` into the best."""
        nonlocal best, ties
        top = float(sims.max())
        if top < best:
            return
        if top > best:
            best = top
            ties = set()
        for j in np.flatnonzero(sims == top).tolist():
            ties.add((int(starts[j]), sizes if isinstance(sizes, int) else sizes[j]))

    def score(texts: list[str], starts: Sequence[int], sizes: Sequence[int] | int) -> None:
        d = process.cdist([c], texts, scorer=Indel.distance, dtype=np.int32, workers=1)[0]
        lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        take(1.0 - d / (la + lens), starts, sizes)

    def score_block(k: int) -> None:
        """Score every window starting in block k, in one rapidfuzz call."""
        a = k * _BLOCK
        b = min(a + _BLOCK, n_starts)
        texts: list[str] = []
        starts: list[int] = []
        sizes: list[int] = []
        for size in range(lo, hi + 1):
            e = min(b, n_w - size + 1)
            if e <= a:
                break
            texts += [canon[x:y] for x, y in zip(ws[a:e], we[a + size - 1 :], strict=False)]
            starts += range(a, e)
            sizes += [size] * (e - a)
        score(texts, starts, sizes)

    def scan() -> None:
        """Score every window, pruning with containment bounds.

        The windows of ``hi`` words are scored first; the LCS ``u[s]`` of window ``(s, hi)``
        bounds the LCS of every shorter window inside it, so window ``(i, L)`` has
        ``LCS <= min(u[s] for s in [i - (hi - L), i])``; it is scored only when
        ``2 * min(that, len(w)) / (len(c) + len(w)) >= best``.
        """
        texts = ch.windows(hi)
        n_hi = len(texts)
        d = process.cdist([c], texts, scorer=Indel.distance, dtype=np.int32, workers=1)[0]
        total = la + (we_a[hi - 1 :] - ws_a[:n_hi])
        take(1.0 - d / total, range(n_hi), hi)
        if lo == hi:
            return
        pad = hi - lo
        padded = np.full(n_hi + 2 * pad, la, dtype=np.int64)
        padded[pad : pad + n_hi] = (total - d) // 2
        running = padded.copy()  # running[x] = min(padded[x - w .. x]) after step w
        texts, starts, sizes = [], [], []
        floor = best - _EPS
        for w in range(1, pad + 1):
            np.minimum(running[w:], padded[:-w], out=running[w:])
            size = hi - w
            n_i = n_w - size + 1
            lens = we_a[size - 1 :] - ws_a[:n_i]
            m = np.minimum(running[pad : pad + n_i], lens)
            idx = np.flatnonzero(2.0 * m / (la + lens) >= floor).tolist()
            if idx:
                texts += [canon[ws[i] : we[i + size - 1]] for i in idx]
                starts += idx
                sizes += [size] * len(idx)
        if texts:
            score(texts, starts, sizes)

    n_blocks = (n_starts + _BLOCK - 1) // _BLOCK
    if n_blocks <= 2:
        scan()
        return best, ties
    block_texts = ch.blocks(hi)[:n_blocks]
    u = process.cdist([c], block_texts, scorer=LCSseq.similarity, dtype=np.int32, workers=1)[0]
    m = np.minimum(u, la)
    bound = 2.0 * m / (la + m)
    order = np.argsort(-bound, kind="stable")
    bound_l = bound.tolist()
    top_bound = bound_l[order[0]]
    if bound_l[order[min(_MAX_BLOCKS, n_blocks - 1)]] >= top_bound - _CLOSE:
        # many blocks look alike (typical of junk): no block stands out, score everything
        scan()
        return best, ties
    score_block(int(order[0]))
    rest = [k for k in order[1:].tolist() if bound_l[k] >= best - _EPS]
    if len(rest) > _MAX_BLOCKS:
        scan()
    else:
        for k in rest:
            if bound_l[k] >= best - _EPS:
                score_block(k)
    return best, ties


# ---------------------------------------------------------------------------- main entry


def recover_candidates(
    chunk_text: str,
    token_spans: Sequence[tuple[int, int]],
    candidates: Sequence[str],
    tau: float = DEFAULT_TAU,
) -> tuple[list[RecoveredSpan], list[AbandonedCandidate]]:
    """Recover each candidate to a token-snapped span of ``chunk_text``, or abandon it.

    See the module docstring for the exact rules. Recovered spans and abandoned candidates come
    back in candidate order; duplicates are kept.

    >>> import re
    >>> text = "Grace O’Malley (Irish: Gráinne Ní Mháille) was a queen. She was a queen."
    >>> spans = [m.span() for m in re.finditer(r"\\s*\\S+|\\s+", text)]  # " word" tokens
    >>> cands = ["Grace O'Malley (Irish: Grainne Ni Mhaille)", "was a queen", "pirate", "..."]
    >>> got, lost = recover_candidates(text, spans, cands)
    >>> for g in got:
    ...     print(g.match_kind, round(g.similarity, 4), repr(g.text), g.tok_start, g.occurrences)
    fuzzy 0.9655 'Grace O’Malley (Irish: Gráinne Ní Mháille)' 0 1
    exact 1.0 ' was a queen.' 6 2
    >>> [(a.candidate, a.reason, round(a.best_similarity, 3)) for a in lost]
    [('pirate', 'below_threshold', 0.545), ('...', 'no_word', 0.0)]
    """
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must lie in [0, 1], got {tau}")
    if chunk_text and not len(token_spans):
        raise ValueError("token_spans is empty for a non-empty chunk")
    ch = _Chunk(chunk_text)
    text = chunk_text
    n_text = len(text)
    recovered: list[RecoveredSpan] = []
    abandoned: list[AbandonedCandidate] = []
    cursor = 0

    for cand in candidates:
        stripped = cand.strip()
        if not stripped:
            abandoned.append(AbandonedCandidate(cand, 0.0, REASON_EMPTY))
            continue
        if _HAS_ALNUM_RE.search(stripped) is None:
            abandoned.append(AbandonedCandidate(cand, 0.0, REASON_NO_WORD))
            continue
        size = len(stripped)
        if size > n_text:
            abandoned.append(AbandonedCandidate(cand, 0.0, REASON_TOO_LONG))
            continue

        # 1. exact, raw text (all occurrences on word boundaries)
        hits = []
        k = text.find(stripped)
        if k >= 0:
            word_first = _is_word_char(stripped[0])
            word_last = _is_word_char(stripped[-1])
            while k >= 0:
                e = k + size
                if not (
                    (word_first and k > 0 and _is_word_char(text[k - 1]))
                    or (word_last and e < n_text and _is_word_char(text[e]))
                ):
                    hits.append(k)
                k = text.find(stripped, k + 1)
        if hits:
            kind = EXACT
            sim = 1.0
            occ = len(hits)
            k = hits[0]
            if k < cursor:
                k = next((h for h in hits if h >= cursor), k)
            cs, ce = k, k + size
        else:
            kind = FUZZY
            canon, orig = ch.canon
            c = canonical_form(stripped)
            # 2. exact, canonical text (a hit implies at least n words: too_long cannot apply)
            hits = _find_all(canon, c)
            if hits:
                sim = 1.0
                occ = len(hits)
                k = next((h for h in hits if orig[h] >= cursor), hits[0])
                cs, ce = int(orig[k]), int(orig[k + len(c) - 1]) + 1
            else:
                n = c.count(" ") + 1
                lo, hi = window_word_range(n)
                if lo > len(ch.words[0]):
                    abandoned.append(AbandonedCandidate(cand, 0.0, REASON_TOO_LONG))
                    continue
                # 3. fuzzy, whole-word windows
                sim, ties = _fuzzy_search(ch, c, n, lo, hi)
                if sim < tau:
                    abandoned.append(AbandonedCandidate(cand, sim, REASON_BELOW))
                    continue
                ws, we, _, _ = ch.words
                i, size = min(
                    ties, key=lambda t: (orig[ws[t[0]]] < cursor, t[0], abs(t[1] - n), t[1])
                )
                occ = len({t[0] for t in ties})
                a, b = trim_edge_punctuation(canon, ws[i], we[i + size - 1], c)
                cs, ce = int(orig[a]), int(orig[b - 1]) + 1

        ts = bisect_right(token_spans, cs, key=_END)
        te = bisect_left(token_spans, ce, key=_START)
        if ts >= te:
            raise ValueError(f"char span [{cs}, {ce}) is covered by no token")
        left = text[token_spans[ts][0] : cs]
        right = text[ce : token_spans[te - 1][1]]
        if (left and not left.isspace()) or (right and not right.isspace()):  # reach out
            c = canonical_form(stripped) if kind == EXACT else c
            ts, te = shed_edge_tokens(text, token_spans, ts, te, cs, ce, c)
        cs = int(token_spans[ts][0])
        ce = int(token_spans[te - 1][1])
        recovered.append(_span(cand, text[cs:ce], kind, sim, cs, ce, ts, te, occ))
        cursor = cs
    return recovered, abandoned
