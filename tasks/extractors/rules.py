"""Model-free nugget extraction: sentence and clause segmentation, spans copied verbatim.

The fastest backend and a baseline for the LLM ones. A passage is cut into whitespace-delimited
words (each with its char offsets), then:

1. into sentences, at words ending in ``. ! ?`` (not abbreviations such as ``Dr.``, ``U.S.`` or an
   initial ``C.``; a ``.`` counts only before an upper-case word, a digit, a quote or the end) and
   at line breaks, except one inside a hard-wrapped paragraph (a single line break between two
   lines of prose at the same indentation: not a bullet, enumerator, directive, prompt or rule
   line, see ``_is_prose``; a line ending in ``.`` still ends its sentence);
2. into clauses, at words ending in ``;`` or ``:``;
3. a clause longer than ``split_words`` words is cut at a comma before a relative word or a
   conjunction (``..., which``, ``..., and``; not inside a list), one longer than ``max_words``
   also at other commas, then into equal runs of words; each side keeps ``min_words`` words;
4. spans of ``min_words..max_words`` words are kept, with a trailing ``, ; :`` dropped.

Every candidate is ``text[start:end]`` for a word-aligned ``(start, end)``: verbatim, in document
order, non-overlapping. The word segmentation (:func:`segment_words`) is shared with the
``local`` backend, which uses its clause ends as the points where a copied span must stop.

CallRecords: none. This backend makes no model call, so it adds nothing to the call ledger.

>>> RulesExtractor().spans("He was born in 1927 in Aracataca, Colombia. He died in 2014.")
['He was born in 1927 in Aracataca, Colombia.', 'He died in 2014.']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from coinrag.schemas.keys import fingerprint
from coinrag.tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    Extractor,
    ResultFn,
    ResultReporter,
)

RULES_VERSION = "rules-v2"  # v2: a wrapped line of a paragraph no longer ends a sentence

_WORD = re.compile(r"\S+")
_CLOSERS = "\"'”’»)]}"
_OPENERS = "\"'“‘«([{"
_TRAILING_TRIM = ",;:"
# Lower-cased, without the final '.': words that end in '.' without ending a sentence.
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st sr jr vs etc e.g i.e no nos vol vols fig figs inc ltd co corp mt ft "
    "gen col lt sgt capt rev gov sen rep pres approx ca c cf al ed eds est dept univ jan feb "
    "mar apr jun jul aug sep sept oct nov dec u.s u.k u.n a.m p.m d.c b.c a.d".split()
)
_COORDINATORS = frozenset("and or nor".split())
# Words after ", " that open a new clause: where a long sentence may be cut.
_CLAUSE_OPENERS = frozenset(
    "and but or nor so yet which who whom whose where when while whereas although though "
    "because since after before until unless including whereby thereby making becoming".split()
)
_SUBORDINATORS = _CLAUSE_OPENERS - _COORDINATORS


@dataclass(frozen=True)
class WordSpans:
    """A passage cut into whitespace-delimited words; all lists have length ``n`` (words).

    ``starts[i]``, ``ends[i]``: char offsets of word ``i`` in ``text`` (``text[starts[i]:ends[i]]``
    is the word). ``clause_end[i]``: a copied span must stop after word ``i`` (sentence end,
    ``;`` or ``:``, a line break, the last word). ``sentence_end[i]``: the subset that ends a
    sentence (``. ! ?``, a line break, the last word). ``soft_end[i]``: a natural place to stop
    inside a clause: word ``i`` ends with a comma, or word ``i + 1`` opens a subordinate clause
    (``which``, ``because``, ...; not a bare ``and``/``or``) or a parenthesis.
    """

    text: str
    starts: list[int]
    ends: list[int]
    clause_end: list[bool]
    sentence_end: list[bool]
    soft_end: list[bool]

    def __len__(self) -> int:
        return len(self.starts)

    def word(self, i: int) -> str:
        return self.text[self.starts[i] : self.ends[i]]

    def char_span(self, first: int, last: int) -> tuple[int, int]:
        """Char offsets of words ``first..last`` (inclusive), without a trailing ``, ; :``.

        The result is word-aligned at the start; at the end it stops at a word's end or before
        that word's trailing punctuation, so it never cuts inside letters or digits.
        """
        start, end = self.starts[first], self.ends[last]
        while end > start and (
            self.text[end - 1] in _TRAILING_TRIM or self.text[end - 1].isspace()
        ):
            end -= 1
        return start, end


def _is_abbreviation(word: str) -> bool:
    """``Dr.``, ``U.S.``, ``e.g.``, an initial ``C.``: a '.' that does not end a sentence."""
    body = word.rstrip(_CLOSERS).lstrip(_OPENERS)
    if not body.endswith("."):
        return False
    stem = body[:-1]
    if len(stem) == 1 and stem.isalpha():
        return True
    if stem.lower() in _ABBREVIATIONS:
        return True
    # dotted acronyms: "U.S.A", "Ph.D"
    return "." in stem and all(len(part) <= 2 and part.isalpha() for part in stem.split("."))


_ENUMERATOR = re.compile(r"(?:\d{1,2}|[A-Za-z#])[.)]|\(\w{1,2}\)")


def _is_prose(first_word: str) -> bool:
    """A line starting with this word continues a wrapped paragraph, unless it is a block of
    its own: a bullet, an enumerator (``1.``, ``a)``), a directive or prompt (``..``, ``>>>``),
    a table or heading rule (no letter or digit at all).

    >>> [_is_prose(w) for w in ["the", "``x``", "(1951)", "-", "1.", "..", "====", ">>>"]]
    [True, True, True, False, False, False, False, False]
    """
    return any(ch.isalnum() for ch in first_word) and not _ENUMERATOR.fullmatch(first_word)


def _opens_sentence(word: str) -> bool:
    first = word.lstrip(_OPENERS)[:1]
    return word[:1] in _OPENERS or first.isupper() or first.isdigit() or not first


def segment_words(text: str) -> WordSpans:
    """Cut ``text`` into words with char offsets and clause/sentence-end flags.

    >>> ws = segment_words("Dr. Smith met U.S. officials; they agreed. Then\\n\\nnothing")
    >>> [ws.word(i) for i in range(len(ws)) if ws.clause_end[i]]
    ['officials;', 'agreed.', 'Then', 'nothing']
    >>> ws = segment_words("a paragraph wrapped\\nat the margin\\n- a bullet")
    >>> [ws.word(i) for i in range(len(ws)) if ws.sentence_end[i]]
    ['margin', 'bullet']
    """
    matches = list(_WORD.finditer(text))
    starts = [m.start() for m in matches]
    ends = [m.end() for m in matches]
    n = len(matches)
    sentence_end = [False] * n
    clause_end = [False] * n
    soft_end = [False] * n
    line_indent, line_prose = 0, True  # the line of word i: its indentation, starts prose
    for i, m in enumerate(matches):
        word = m.group()
        last = i == n - 1
        gap = "" if last else text[ends[i] : starts[i + 1]]
        body = word.rstrip(_CLOSERS)
        if i == 0 or "\n" in text[ends[i - 1] : starts[i]]:
            line_start = text.rfind("\n", 0, starts[i]) + 1
            line_indent, line_prose = starts[i] - line_start, _is_prose(word)
        wrapped = (  # "." before a line break ends a sentence, even after "C." or "Dr."
            gap.count("\n") == 1
            and not body.endswith(".")
            and line_prose
            and _is_prose(matches[i + 1].group())
            and len(gap) - gap.index("\n") - 1 == line_indent
        )
        if last or ("\n" in gap and not wrapped) or body.endswith(("!", "?")):
            sentence_end[i] = True
        elif body.endswith("...") or (
            body.endswith(".")
            and not _is_abbreviation(word)
            and _opens_sentence(matches[i + 1].group())
        ):
            sentence_end[i] = True
        clause_end[i] = sentence_end[i] or body.endswith((";", ":"))
        nxt = "" if last else matches[i + 1].group()
        soft_end[i] = (
            body.endswith(",") or nxt.lower() in _SUBORDINATORS or nxt.startswith(("(", "["))
        )
    return WordSpans(text, starts, ends, clause_end, sentence_end, soft_end)


def runs_after(flags: Sequence[bool], lo: int, hi: int) -> list[tuple[int, int]]:
    """Split words ``lo..hi-1`` after every word whose flag is set: ``[(first, last+1), ...]``."""
    out, start = [], lo
    for i in range(lo, hi):
        if flags[i] or i == hi - 1:
            out.append((start, i + 1))
            start = i + 1
    return out


class RulesExtractor(Extractor, name="rules"):
    """Clause segmentation without a model (backend ``"rules"``).

    Options: ``min_words`` / ``max_words`` bound a kept span; a clause longer than
    ``split_words`` is cut at a comma before a conjunction or relative word.
    """

    stage_answers = False
    llm_model = "none"
    prompt_version = RULES_VERSION  # the segmentation rules stand where a prompt would

    def __init__(self, min_words: int = 3, max_words: int = 25, split_words: int = 16) -> None:
        if not 1 <= min_words <= max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
        if split_words < 2 * min_words:
            raise ValueError(f"split_words={split_words} must be >= 2 * min_words ({min_words})")
        self.min_words = min_words
        self.max_words = max_words
        self.split_words = split_words

    @property
    def fingerprint(self) -> str:
        return fingerprint(
            "extractor",
            {
                "backend": self.backend,
                "version": RULES_VERSION,
                "min_words": self.min_words,
                "max_words": self.max_words,
                "split_words": self.split_words,
            },
        )

    def _cut(self, ws: WordSpans, lo: int, hi: int) -> list[tuple[int, int]]:
        """Cut words ``lo..hi-1`` of one clause into pieces no longer than needed.

        Cut points, best first (a cut after word ``i``): a comma before a relative word or a
        subordinating conjunction (``, which``, ``, although``); a comma before ``and``/``or``
        that does not sit inside a list of short items; then, only for a clause over
        ``max_words``: any such comma, a conjunction without a comma, any comma. The most
        balanced cut of the best kind is taken, recursively; at the end equal runs of words.
        """
        n = hi - lo
        if n <= self.split_words:
            return [(lo, hi)]
        words = [ws.word(i) for i in range(lo, hi)]
        commas = [lo + k for k, w in enumerate(words[:-1]) if w.rstrip(_CLOSERS).endswith(",")]
        listy = _list_commas(commas, lo, hi)
        nxt = {i: ws.word(i + 1).lower() for i in range(lo, hi - 1)}
        relative = [i for i in commas if nxt[i] in _CLAUSE_OPENERS - _COORDINATORS]
        coord = [i for i in commas if nxt[i] in _COORDINATORS and i not in listy]
        tiers = [relative, coord]
        if n > self.max_words:
            bare = [i for i in range(lo, hi - 1) if nxt[i] in _CLAUSE_OPENERS and i not in commas]
            tiers += [[i for i in commas if i not in listy], bare, commas]
        for options in tiers:
            ok = [
                i for i in options if i + 1 - lo >= self.min_words and hi - i - 1 >= self.min_words
            ]
            if ok:
                mid = min(ok, key=lambda i: abs((i + 1 - lo) - (hi - i - 1)))  # most balanced
                return self._cut(ws, lo, mid + 1) + self._cut(ws, mid + 1, hi)
        if n <= self.max_words:
            return [(lo, hi)]
        parts = -(-n // self.max_words)  # ceil: equal runs, each <= max_words
        bounds = [lo + round(k * n / parts) for k in range(parts + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def word_spans(self, text: str) -> list[tuple[int, int]]:
        """Word ranges ``[(first, last+1), ...]`` of the kept spans, in document order."""
        ws = segment_words(text)
        pieces: list[tuple[int, int]] = []
        for s_lo, s_hi in runs_after(ws.sentence_end, 0, len(ws)):
            for c_lo, c_hi in merge_short(runs_after(ws.clause_end, s_lo, s_hi), self.min_words):
                pieces.extend(self._cut(ws, c_lo, c_hi))
        return [(a, b) for a, b in pieces if self.min_words <= b - a <= self.max_words]

    def char_spans(self, text: str) -> list[tuple[int, int]]:
        """Char offsets ``[(start, end), ...]`` of the candidates in ``text``."""
        ws = segment_words(text)
        return [ws.char_span(a, b - 1) for a, b in self.word_spans(text)]

    def spans(self, text: str) -> list[str]:
        """The candidates of one passage: verbatim substrings, in document order."""
        return [text[s:e] for s, e in self.char_spans(text)]

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One result per request, in order; a failure on one text is recorded, not raised."""
        results = []
        report = ResultReporter(on_result)
        for req in requests:
            try:
                results.append(ExtractionResult(req.key, "ok", self.spans(req.text)))
            except Exception as exc:  # noqa: BLE001 - one bad chunk must not stop the batch
                results.append(
                    ExtractionResult(req.key, "failed", error=f"{type(exc).__name__}: {exc}")
                )
            report(results[-1])
        return results


def merge_short(runs: list[tuple[int, int]], min_words: int) -> list[tuple[int, int]]:
    """Merge a clause shorter than ``min_words`` into its neighbour within the same sentence.

    ``[(0, 2), (2, 9)]`` with ``min_words=3`` -> ``[(0, 9)]``: a short lead-in such as
    ``"Born:"`` stays attached to what it introduces.
    """
    out: list[tuple[int, int]] = []
    for lo, hi in runs:
        if out and (hi - lo < min_words or out[-1][1] - out[-1][0] < min_words):
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _list_commas(commas: list[int], lo: int, hi: int, item_words: int = 3) -> set[int]:
    """Commas inside a list of short items: both neighbouring comma-runs have <= 3 words.

    In ``"stars A B, C D, and E F, and follows a voyage"`` the commas after ``B`` and ``D`` are
    list commas; the one after ``F`` (before ``and follows a voyage``) is not.
    """
    bounds = [lo - 1, *commas, hi - 1]
    return {
        c
        for k, c in enumerate(commas, start=1)
        if c - bounds[k - 1] <= item_words and bounds[k + 1] - c <= item_words
    }
