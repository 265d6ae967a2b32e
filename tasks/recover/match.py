"""Span matching of nugget recovery: map an LLM's "verbatim" candidate back to exact offsets inside
a chunk (pure; the recover stage, ``tasks/recover/stage.py``, applies it to the store).

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
exactly. At the edges, a token that holds any character of the candidate's matched text stays,
with the marks it holds beyond it; a token of nothing but marks the candidate lacks is never
taken (the matched span ends on the candidate's own characters). So punctuation the candidate
lacks is in the text only where a tokenizer glues it into a token with the candidate's
characters: SmolLM2 splits ``","`` and ``"."`` into tokens of their own (they stay out), but reads
``"(1368–1644)."`` as ``... "4", ")."``, and the candidate ``"built by the Ming dynasty
(1368-1644)"`` recovers ``" built by the Ming dynasty (1368–1644)."``: the ``"."`` comes with the
candidate's own ``")"``, which is never dropped, since a nugget is whole tokens.

Duplicates are kept: candidates landing on the same span give several ``RecoveredSpan`` (the
caller dedupes by token span).

Speed: all chunk structures (canonical text and map, word offsets, window and block texts) are
built at most once per chunk, lazily; the exact stages cost two ``str.find`` scans. The fuzzy
stage returns exactly what scoring every window would (``tests/recover_reference.py`` does that)
but prunes with upper bounds from ``LCS(c, w) <= LCS(c, t)`` for any text ``t`` containing window
``w``: blocks of window starts are bounded in one rapidfuzz call and scored best bound first, and
when no block stands out (typical of junk) the longest windows are scored first and bound the
shorter windows inside them. Nothing whose bound reaches the best similarity is skipped.

Where each part lives: the canonical form and word boundaries in ``tasks/recover/canon.py``, the
fuzzy window search in ``tasks/recover/fuzzy.py``, token snapping in ``tasks/recover/tokens.py``;
this module holds the records and the order of the stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from coinrag.tasks.recover.canon import (
    HAS_ALNUM_RE,
    canonical_form,
    find_all_on_boundaries,
    fold_char,
    is_word_char,
    trim_edge_punctuation,
    window_word_range,
)
from coinrag.tasks.recover.fuzzy import ChunkIndex, FuzzySearch
from coinrag.tasks.recover.tokens import char_span_to_token_span

__all__ = [
    "AbandonedCandidate",
    "RecoveredSpan",
    "canonical_form",
    "char_span_to_token_span",
    "fold_char",
    "recover_candidates",
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


@dataclass(frozen=True)
class AbandonedCandidate:
    """A candidate that could not be recovered."""

    candidate: str
    best_similarity: float  # best window similarity (0.0 when no window was scored)
    reason: str  # "empty" | "no_word" | "too_long" | "below_threshold"


class _Match(NamedTuple):
    """Where one stage placed a candidate, before token snapping: char span ``[cs, ce)`` of the
    chunk text, from the first to the last of the candidate's matched characters."""

    kind: str
    sim: float
    cs: int
    ce: int
    occ: int


class _Miss(NamedTuple):
    """Why a stage abandoned a candidate, with the best similarity it saw."""

    sim: float
    reason: str


_MISS_EMPTY = _Miss(0.0, REASON_EMPTY)
_MISS_NO_WORD = _Miss(0.0, REASON_NO_WORD)
_MISS_TOO_LONG = _Miss(0.0, REASON_TOO_LONG)


def _early_miss(stripped: str, n_text: int) -> _Miss | None:
    """Step 1: a candidate abandoned before any search (empty, no word, longer than the chunk)."""
    if not stripped:
        return _MISS_EMPTY
    if HAS_ALNUM_RE.search(stripped) is None:
        return _MISS_NO_WORD
    if len(stripped) > n_text:
        return _MISS_TOO_LONG
    return None


def _exact_raw(text: str, stripped: str, cursor: int) -> _Match | None:
    """Step 2: every verbatim occurrence on word boundaries; the first at or after ``cursor``
    wins, else the first."""
    k = text.find(stripped)
    if k < 0:
        return None
    size = len(stripped)
    n_text = len(text)
    word_first = is_word_char(stripped[0])
    word_last = is_word_char(stripped[-1])
    hits = []
    while k >= 0:
        e = k + size
        if not (
            (word_first and k > 0 and is_word_char(text[k - 1]))
            or (word_last and e < n_text and is_word_char(text[e]))
        ):
            hits.append(k)
        k = text.find(stripped, k + 1)
    if not hits:
        return None
    k = hits[0]
    if k < cursor:
        k = next((h for h in hits if h >= cursor), k)
    return _Match(EXACT, 1.0, k, k + size, len(hits))


def _exact_canonical(chunk: ChunkIndex, c: str, cursor: int) -> _Match | None:
    """Step 3: the canonical candidate in the canonical chunk on word boundaries, mapped back
    to source characters (a hit implies at least n words: too_long cannot apply)."""
    canon, orig = chunk.canon
    hits = find_all_on_boundaries(canon, c)
    if not hits:
        return None
    k = next((h for h in hits if orig[h] >= cursor), hits[0])
    return _Match(FUZZY, 1.0, int(orig[k]), int(orig[k + len(c) - 1]) + 1, len(hits))


def _fuzzy(chunk: ChunkIndex, c: str, cursor: int, tau: float) -> _Match | _Miss:
    """Step 4: the best whole-word window, accepted at ``sim >= tau``; among ties the first
    at or after ``cursor``, then by start, word count closest to ``n``, the shorter; its edge
    punctuation the candidate lacks is trimmed."""
    canon, orig = chunk.canon
    ws, we, _, _ = chunk.words
    n = c.count(" ") + 1
    lo, hi = window_word_range(n)
    if lo > len(ws):
        return _MISS_TOO_LONG
    sim, ties = FuzzySearch(chunk, c, lo, hi).run()
    if sim < tau:
        return _Miss(sim, REASON_BELOW)
    i, size = min(ties, key=lambda t: (orig[ws[t[0]]] < cursor, t[0], abs(t[1] - n), t[1]))
    a, b = trim_edge_punctuation(canon, ws[i], we[i + size - 1], c)
    occ = len({t[0] for t in ties})
    return _Match(FUZZY, sim, int(orig[a]), int(orig[b - 1]) + 1, occ)


def _locate(chunk: ChunkIndex, stripped: str, cursor: int, tau: float) -> _Match | _Miss:
    """The first stage that places the candidate, or why it is abandoned."""
    miss = _early_miss(stripped, len(chunk.text))
    if miss is not None:
        return miss
    found = _exact_raw(chunk.text, stripped, cursor)
    if found is not None:
        return found
    c = canonical_form(stripped)
    found = _exact_canonical(chunk, c, cursor)
    return found if found is not None else _fuzzy(chunk, c, cursor, tau)


_new = object.__new__
_set = object.__setattr__


def _snapped_span(
    cand: str, found: _Match, text: str, token_spans: Sequence[tuple[int, int]]
) -> RecoveredSpan:
    """The recovered span of ``found`` snapped to whole tokens; built without the frozen
    ``__init__`` (nine ``object.__setattr__`` calls, the largest cost of an exact hit); the
    object is the same."""
    ts, te = char_span_to_token_span(token_spans, found.cs, found.ce)
    cs = int(token_spans[ts][0])
    ce = int(token_spans[te - 1][1])
    span = _new(RecoveredSpan)
    _set(
        span,
        "__dict__",
        {
            "candidate": cand,
            "text": text[cs:ce],
            "match_kind": found.kind,
            "similarity": found.sim,
            "char_start": cs,
            "char_end": ce,
            "tok_start": ts,
            "tok_end": te,
            "occurrences": found.occ,
        },
    )
    return span


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
    chunk = ChunkIndex(chunk_text)
    recovered: list[RecoveredSpan] = []
    abandoned: list[AbandonedCandidate] = []
    cursor = 0
    for cand in candidates:
        stripped = cand.strip()
        found = _locate(chunk, stripped, cursor, tau)
        if isinstance(found, _Miss):
            abandoned.append(AbandonedCandidate(cand, found.sim, found.reason))
            continue
        span = _snapped_span(cand, found, chunk_text, token_spans)
        recovered.append(span)
        cursor = span.char_start
    return recovered, abandoned
