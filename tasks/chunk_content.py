"""Content-defined boundaries (the ``content`` chunker): cuts that resynchronise after an edit.

With ``fixed`` or ``sentence`` chunking each boundary is placed relative to the previous one, so
an edit in the middle of a document moves every later boundary and the whole rest is re-chunked
(new nuggets, KV and embeddings for every later chunk). Here whether a position is a boundary
depends only on the text near it, never on its offset, so boundaries away from an edit stay put.

Positions are token cut indices: cut ``c`` means a chunk ends before token ``c``.

1. **Candidates**: cuts right after a sentence end followed by whitespace (``"... end. Next"``
   cuts before ``" Next"``) or right before a blank line.
2. **Anchors**: candidates whose local hash ``u`` is below ``gap / target``. ``u`` is blake2b of
   the ``CONTEXT_BEFORE`` characters before the cut and ``CONTEXT_AFTER`` after it, read as a
   number in ``[0, 1)``; ``gap`` is the number of tokens since the previous candidate (or the
   document start). So there is about one anchor per ``target`` tokens whatever the sentence
   lengths, and a candidate's anchor status depends only on the text from the previous
   candidate to a few characters after it.
3. **Segment cuts**: anchors at least ``min`` tokens after the previous anchor (any anchor, cut or
   not) and at least ``min`` tokens before the document end. Two consecutive segment cuts are
   therefore at least ``min`` apart, and whether an anchor is a segment cut depends only on the
   text from the previous anchor to it (and, near the end, on the document's length after it).
4. **Long segments** (more than ``max`` = chunk_size tokens) are split inside, from their start:
   in ``[a + min, min(a + max, end - min)]`` the candidate with the smallest ``u``, else the line
   break with the smallest ``u``, else the last word start, else the window's end. These cuts
   depend only on the segment's text.
5. A document of at most ``max`` tokens is one chunk.

Guarantee (property-tested in ``tests/tasks/test_chunk_content.py``): for documents of more than
``max`` tokens before and after an edit of the characters ``[x, y)``,

- every chunk ending at or before the last segment cut before the edit (its hash context ending
  before ``x``) is unchanged, provided at least ``min`` tokens still follow that cut;
- let ``A`` be the first anchor whose previous candidate lies after the edit (hash contexts
  included); every chunk starting at or after the first segment cut after ``A`` is unchanged
  (same text, same tokens, so the same ``text_hash`` and ``content_key``).

The chunks in between are re-chunked: typically the one or two segments around the edit. Where
the text has no candidates (no sentence ends, no blank lines), nothing is guaranteed beyond
what ``sentence`` chunking gives. "Same text near a cut" assumes the tokenizer's pre-tokens do
not reach across the hash context (true of byte-level BPE on ordinary words).

Worked example of step 3 (min = 3): anchors at cuts 5, 7, 12, 20 in a 40-token document give
segment cuts 5 (5 - 0 >= 3), not 7 (7 - 5 < 3), 12 (12 - 7 >= 3), 20: chunks [0, 5), [5, 12),
[12, 20), [20, 40). An edit well inside [7, 12) can change the decisions at 12 and 20 only
(their previous anchor or gap may move); from the anchor after 20 on, the decisions are those
of before.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CONTEXT_BEFORE = 32  # characters hashed before a cut
CONTEXT_AFTER = 8  # characters hashed after a cut
MIN_FRACTION = 0.25  # default min_tokens = chunk_size * MIN_FRACTION
TARGET_FRACTION = 0.25  # default target_tokens = chunk_size * TARGET_FRACTION

SENTENCE_END = re.compile(r"[.!?…][\"'”’)\]]*\s*$")  # a text that ends a sentence
_SENTENCE_CUT = re.compile(r"[.!?…][\"'”’)\]]*(?=\s)")  # match end: after a sentence end
_PARAGRAPH_CUT = re.compile(r"(?<=[^\n])\n[ \t]*\n")  # match start: before a blank line
_LINE_CUT = re.compile(r"(?<=[^\n])\n")  # match start: before a line break


@dataclass(frozen=True)
class ContentParams:
    """Sizes of the content chunker, in tokens (``max_tokens`` is the chunk_size)."""

    max_tokens: int
    min_tokens: int
    target_tokens: int

    @classmethod
    def for_chunk_size(cls, chunk_size: int) -> ContentParams:
        """The defaults: min = target = chunk_size / 4 (mean chunk about chunk_size / 2)."""
        return cls(
            chunk_size,
            max(1, int(chunk_size * MIN_FRACTION)),
            max(1, int(chunk_size * TARGET_FRACTION)),
        ).validate()

    def validate(self) -> ContentParams:
        """Raise ValueError naming the bad size; return self."""
        if not 1 <= self.min_tokens <= self.max_tokens // 2:
            raise ValueError(
                f"content chunker min_tokens {self.min_tokens} must be in "
                f"1..chunk_size/2 ({self.max_tokens // 2})"
            )
        if self.target_tokens < 1:
            raise ValueError(f"content chunker target_tokens {self.target_tokens} must be >= 1")
        return self

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything the boundaries depend on (for ``chunker_fingerprint``)."""
        return {
            "max": self.max_tokens,
            "min": self.min_tokens,
            "target": self.target_tokens,
            "context": [CONTEXT_BEFORE, CONTEXT_AFTER],
            "hash": "blake2b-64",
            "v": 1,
        }


@dataclass(frozen=True)
class ContentPlan:
    """Where the content chunker cuts one document (token cut indices, ascending)."""

    candidates: list[int]  # sentence ends and blank lines
    anchors: list[int]  # candidates whose local hash hit
    segment_starts: list[int]  # anchors that are cuts (step 3)
    cuts: list[int]  # every cut: segment starts and the cuts inside long segments


def token_text(text: str, ends: Sequence[int], i: int) -> str:
    """The text of token ``i`` (``ends[i]`` = char offset where token i ends)."""
    return text[(ends[i - 1] if i > 0 else 0) : ends[i]]


def local_hash(text: str, pos: int) -> float:
    """Hash in ``[0, 1)`` of the characters around char offset ``pos`` (not of ``pos``)."""
    context = text[max(0, pos - CONTEXT_BEFORE) : pos + CONTEXT_AFTER]
    digest = hashlib.blake2b(context.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _cuts_at(pattern: re.Pattern[str], text: str, cut_of: dict[int, int], start: bool) -> set[int]:
    """Token cuts at the matches of ``pattern`` (their start or end) that are token boundaries."""
    out = set()
    for m in pattern.finditer(text):
        cut = cut_of.get(m.start() if start else m.end())
        if cut is not None:
            out.add(cut)
    return out


def content_plan(text: str, ends: Sequence[int], params: ContentParams) -> ContentPlan:
    """The cuts of one tokenized document (``ends`` as in ``tasks.chunk.TokenizedText``)."""
    n = len(ends)
    if n <= params.max_tokens:
        return ContentPlan([], [], [], [])
    # char offset of a token boundary -> cut index; the last token ending there wins, so a cut
    # never falls between the byte-level tokens of one character.
    cut_of = {ends[i]: i + 1 for i in range(n - 1)}
    pos = [0, *ends]  # pos[c] = char offset of cut c
    candidates = sorted(
        _cuts_at(_SENTENCE_CUT, text, cut_of, start=False)
        | _cuts_at(_PARAGRAPH_CUT, text, cut_of, start=True)
    )
    u = {c: local_hash(text, pos[c]) for c in candidates}
    anchors = []
    prev = 0
    for c in candidates:
        if u[c] * params.target_tokens < c - prev:
            anchors.append(c)
        prev = c
    starts = []
    prev = 0
    for c in anchors:
        if c - prev >= params.min_tokens and n - c >= params.min_tokens:
            starts.append(c)
        prev = c
    lines: list[int] | None = None
    cuts: list[int] = []
    for a, e in zip([0, *starts], [*starts, n], strict=True):
        if e - a > params.max_tokens and lines is None:
            lines = sorted(_cuts_at(_LINE_CUT, text, cut_of, start=True))
        while e - a > params.max_tokens:
            lo, hi = a + params.min_tokens, min(a + params.max_tokens, e - params.min_tokens)
            a = (
                _smallest_hash(candidates, lo, hi, lambda c: u[c])
                or _smallest_hash(lines or [], lo, hi, lambda c: local_hash(text, pos[c]))
                or _last_word_start(text, pos, lo, hi)
                or hi
            )
            cuts.append(a)
        if e < n:
            cuts.append(e)
    return ContentPlan(candidates, anchors, starts, cuts)


def _smallest_hash(cuts: list[int], lo: int, hi: int, hash_of: Any) -> int | None:
    """The cut in ``[lo, hi]`` with the smallest hash (the first on ties), or None."""
    inside = cuts[bisect.bisect_left(cuts, lo) : bisect.bisect_right(cuts, hi)]
    return min(inside, key=hash_of) if inside else None


def _last_word_start(text: str, pos: list[int], lo: int, hi: int) -> int | None:
    """The last cut in ``[lo, hi]`` before whitespace, or None."""
    for c in range(hi, lo - 1, -1):
        if text[pos[c] : pos[c] + 1].isspace():
            return c
    return None
