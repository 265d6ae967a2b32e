"""The span-copy constraint of the local extractor: a passage as words and tokens, and the
state machine that lets a model only copy runs of the passage's own tokens.

The answer it allows is a list, one span per line::

    - <copy of passage words w_a .. w_b>\\n
    - <copy of passage words w_c .. w_d>\\n
    <|im_end|>

The passage is cut into whitespace-delimited words (``rules.segment_words``) and each word is
tokenized as ``" " + word``: the form it has after ``"-"`` or a previous word in byte-level BPE
(``"ĠGarcÃŃa"``), so a token never straddles two words and a span maps back to char offsets
through its word indices, not by decoding. The constraint (:class:`SpanCopyMachine`) per step:

- line start: ``"-"`` (another span) or end-of-turn; ``"-"`` is forced before the first span
  and while a clause head (below) is still ahead, end-of-turn after the budget of spans or when
  no admissible start is left;
- span start: the first token of an admissible word at or after the cursor (spans are in document
  order and never overlap); admissible: at least ``min_words`` words run from it to the next
  clause end, and with ``boundaries="clause"`` (default) it opens a clause: the passage's first
  word, or one after ``. ; : ! ?``, after a comma, or ``which``/``because``... but not ``(``
  (``"word"``: any word). Coverage: the first admissible word of every clause (a clause shorter
  than ``min_words`` merged into its neighbour) is a *head* that must start a span, so no word
  before the next head is offered unless the budget leaves room for the heads still ahead;
- inside a span: the next passage token (copy), or ``"\n"`` (end the span) at a soft end
  (``"clause"``: a comma or a clause opener next; ``"word"``: any word end) once the span has
  ``min_words`` words (``min_head_words`` for a span from a head). The end is forced after a
  clause end (``. ; : ! ?``, a line break, the last word), at a soft end when the next place to
  stop lies beyond ``max_words``, and at ``max_words`` words, always at a word end, so a cap
  never cuts ``"García M"``.

Why heads: left to choose, SmolLM2-135M skips whole sentences (it kept two spans of the *2001: A
Space Odyssey* summary, neither with "directed by Stanley Kubrick"); a clause's first words carry
its subject and verb, what a question asks about. The budget is ``max(max_nuggets,
ceil(spans_per_head * heads))`` spans per passage: every head, plus spans of the model's choice.

A start token may begin several words (``" the"``); all of them stay candidates and the following
tokens narrow them down, so the model's choice is never silently redirected.

The machine is driven by ``inference.model.constrained.decode_constrained``
(``tasks/extractors/local.py`` builds one per passage); any choice among ``allowed()``, even a
random one, gives verbatim, ordered, non-overlapping, word-aligned spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coinrag.tasks.extractors.rules import WordSpans, merge_short, runs_after, segment_words

# ---------------------------------------------------------------------------------------------
# The passage as the machine sees it


@dataclass(frozen=True)
class PassageTokens:
    """A passage's words and their tokens. ``T`` = number of tokens, ``W`` = number of words.

    ``token_ids[p]`` (length T): token ``p`` of the passage, words tokenized as ``" " + word``.
    ``word_of[p]`` (T): the word token ``p`` belongs to. ``first_token[w]`` (W): index of word
    ``w``'s first token. ``can_start[w]`` (W): a span may start at word ``w``. ``soft_end[w]``
    (W): a span may stop after word ``w`` by choice. ``clause_end[w]`` (W): a span must stop
    after word ``w`` (``rules.WordSpans.clause_end``, with a clause shorter than ``min_words``
    merged into its neighbour: ``"2001:"`` does not end a clause of its own). ``next_stop[w]``
    (W): the first word after ``w`` where a span may stop (soft or clause end; ``W - 1`` at
    most). ``heads`` (sorted word indices): the first word of each clause where a span may start,
    the clause's *head* (its subject and verb usually follow): the words every extraction covers.
    """

    words: WordSpans
    token_ids: list[int]
    word_of: list[int]
    first_token: list[int]
    can_start: list[bool]
    soft_end: list[bool]
    next_stop: list[int]
    clause_end: list[bool]
    heads: list[int]

    def at_boundary(self, p: int) -> bool:
        """Token ``p`` is the last token of its word."""
        return p + 1 == len(self.token_ids) or self.word_of[p + 1] != self.word_of[p]


BOUNDARIES = ("clause", "word")


def tokenize_passage(
    text: str, tokenizer: Any, min_words: int, boundaries: str = "clause"
) -> PassageTokens:
    """Cut ``text`` into words, tokenize each as ``" " + word``, mark where spans may start/stop.

    ``boundaries="clause"``: a span starts at the first word of the passage or after a clause
    end or a soft end (``rules.WordSpans.soft_end``: after a comma, before ``which``/``because``
    or ``(``), never at a word opening with a bracket, and stops by choice only at a soft end.
    ``"word"``: any word may start a span and a span may stop after any word. Either way a start
    needs ``min_words`` words before the next clause end, and a clause shorter than ``min_words``
    is merged into its neighbour in the same sentence (``"2001: A Space Odyssey is ..."`` is one
    clause, as in ``rules``). Each clause's first admissible start is its head.
    """
    if boundaries not in BOUNDARIES:
        raise ValueError(f"boundaries={boundaries!r}: expected one of {BOUNDARIES}")
    words = segment_words(text)
    n = len(words)
    ids: list[list[int]] = (
        tokenizer([" " + words.word(i) for i in range(n)], add_special_tokens=False)["input_ids"]
        if n
        else []
    )
    token_ids: list[int] = []
    word_of: list[int] = []
    first_token: list[int] = []
    for w, toks in enumerate(ids):
        if not toks:  # a tokenizer that drops a word entirely: no way to copy it
            raise ValueError(f"word {words.word(w)!r} tokenizes to nothing")
        first_token.append(len(token_ids))
        token_ids.extend(toks)
        word_of.extend([w] * len(toks))
    soft = [True] * n if boundaries == "word" else list(words.soft_end)
    clause_end = merged_clause_ends(words, min_words)
    can_start = [False] * n
    next_stop = [n - 1] * n
    run, stop = 0, n - 1  # run: words from w through the next clause end
    for w in range(n - 1, -1, -1):
        next_stop[w] = stop
        if soft[w] or clause_end[w]:
            stop = w
        run = 1 if clause_end[w] else run + 1
        opens = w == 0 or soft[w - 1] or clause_end[w - 1]
        if boundaries == "clause" and words.word(w).startswith(("(", "[")):
            opens = False  # stop before "(OAPEC)" by choice, never start a nugget with it
        can_start[w] = opens and run >= min_words
    heads = []
    clause_open = True  # no head found yet in the current clause
    for w in range(n):
        if clause_open and can_start[w]:
            heads.append(w)
            clause_open = False
        if clause_end[w]:
            clause_open = True
    return PassageTokens(
        words, token_ids, word_of, first_token, can_start, soft, next_stop, clause_end, heads
    )


def merged_clause_ends(words: WordSpans, min_words: int) -> list[bool]:
    """``words.clause_end`` without the ends of clauses shorter than ``min_words`` words that
    have a neighbour in their sentence (``rules``' merge: a short lead-in such as ``"2001:"``
    or ``"Born:"`` joins what follows, a short tail joins what precedes).

    >>> from tasks.extractors.rules import segment_words
    >>> ws = segment_words("2001: A Space Odyssey is a film; it is long. Yes: no.")
    >>> [ws.word(i) for i, e in enumerate(merged_clause_ends(ws, 3)) if e]
    ['film;', 'long.', 'no.']
    """
    n = len(words)
    ends = list(words.clause_end)
    start = 0
    for s_end in [i for i in range(n) if words.sentence_end[i]]:
        clauses = runs_after(words.clause_end, start, s_end + 1)
        for _lo, hi in clauses[:-1]:
            ends[hi - 1] = False  # every clause end inside the sentence, restored below
        for _lo, hi in merge_short(clauses, min_words)[:-1]:
            ends[hi - 1] = True
        start = s_end + 1
    return ends


# ---------------------------------------------------------------------------------------------
# The constraint


@dataclass(frozen=True)
class SpecialIds:
    """The token ids the answer is made of besides passage tokens."""

    dash: int  # "-" opening a line
    newline: int  # "\n" ending a span
    eos: int  # end of the assistant turn


@dataclass
class _Cand:
    pos: int  # index of the last copied passage token
    start_word: int
    n_words: int


@dataclass
class SpanCopyMachine:
    """The decoding constraint for one passage: which tokens may come next, and the spans so far.

    Use: ``allowed()`` -> token ids; the chosen one goes to ``advance(token_id)``; repeat until
    ``done``. ``spans`` holds ``(first_word, last_word)`` pairs (inclusive), in document order.
    Every path through the machine ends (each span consumes at least one word and there are at
    most ``max_nuggets`` spans), so any choice among ``allowed()``, even a random one, gives
    verbatim, ordered, non-overlapping, word-aligned spans.

    Coverage: the first ``max_nuggets`` clause heads (``passage.heads``) are *required*: a span
    starts at each of them. The model chooses where such a span ends (by choice only once it
    has ``min_head_words`` words, so it carries the clause's subject, verb and object rather
    than a three-word lead-in) and whether to add spans of its own between two heads, which it
    may only while enough of the budget remains for the heads still ahead; the list ends only
    after the last required head.
    """

    passage: PassageTokens
    special: SpecialIds
    max_nuggets: int
    min_words: int
    max_words: int
    min_head_words: int = 1
    phase: str = "line"  # line | start | span | done
    cursor: int = 0  # first word a new span may start at
    spans: list[tuple[int, int]] = field(default_factory=list)
    n_generated: int = 0
    _cands: list[_Cand] = field(default_factory=list)
    _required: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._required = self.passage.heads[: self.max_nuggets]

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def _heads_left(self) -> list[int]:
        """Required heads not covered yet (all at or after the cursor)."""
        return [h for h in self._required if h >= self.cursor]

    def _starts(self) -> list[int]:
        """Words the next span may start at: the next required head, or (with budget to spare
        for the heads after it) any admissible word before it; after the last head, any."""
        pt = self.passage
        left = self._heads_left()
        last = left[0] if left else len(pt.first_token) - 1
        if left and self.max_nuggets - len(self.spans) <= len(left):
            return [left[0]]
        return [w for w in range(self.cursor, last + 1) if pt.can_start[w]]

    def _min_len(self, c: _Cand) -> int:
        """Words a span needs before it may end at a soft end by choice."""
        head = c.start_word in self._required
        return max(self.min_words, self.min_head_words) if head else self.min_words

    def _forced_end(self, c: _Cand) -> bool:
        """At a word end: a clause end, the cap, or a soft end the next stop lies beyond the cap."""
        pt = self.passage
        if not pt.at_boundary(c.pos):
            return False
        w = pt.word_of[c.pos]
        if pt.clause_end[w] or c.n_words >= self.max_words:
            return True
        return (
            pt.soft_end[w]
            and c.n_words >= self._min_len(c)
            and c.n_words + (pt.next_stop[w] - w) > self.max_words
        )

    def _can_end(self, c: _Cand) -> bool:
        pt = self.passage
        if not pt.at_boundary(c.pos):
            return False
        soft = pt.soft_end[pt.word_of[c.pos]] and c.n_words >= self._min_len(c)
        return soft or self._forced_end(c)

    def forced(self) -> int | None:
        """The one token that must come next, or None when there is a choice."""
        allowed = self.allowed()
        return allowed[0] if len(allowed) == 1 else None

    def allowed(self) -> list[int]:
        """Token ids that may come next (never empty; ``[eos]`` once done)."""
        sp, pt = self.special, self.passage
        if self.phase in ("done",):
            return [sp.eos]
        if self.phase == "line":
            if len(self.spans) >= self.max_nuggets or not self._starts():
                return [sp.eos]
            if not self.spans or self._heads_left():
                return [sp.dash]
            return [sp.dash, sp.eos]
        if self.phase == "start":
            return sorted({pt.token_ids[pt.first_token[w]] for w in self._starts()})
        out: set[int] = set()
        for c in self._cands:
            if self._can_end(c):
                out.add(sp.newline)
            if not self._forced_end(c):
                out.add(pt.token_ids[c.pos + 1])
        return sorted(out)

    def advance(self, token_id: int) -> None:
        """Take the chosen token; raises ValueError for one ``allowed()`` did not offer."""
        sp, pt = self.special, self.passage
        if self.phase == "done":
            return  # padding after the end of a row in a batch
        self.n_generated += 1
        if self.phase == "line":
            if token_id == sp.eos and sp.eos in self.allowed():
                self.phase = "done"
                return
            if token_id == sp.dash and sp.dash in self.allowed():
                self.phase = "start"
                return
        elif self.phase == "start":
            cands = [
                _Cand(pt.first_token[w], w, 1)
                for w in self._starts()
                if pt.token_ids[pt.first_token[w]] == token_id
            ]
            if cands:
                self._cands, self.phase = cands, "span"
                return
        else:  # span
            if token_id == sp.newline:
                ends = [c for c in self._cands if self._can_end(c)]
                if ends:
                    c = ends[0]  # earliest occurrence: candidates are kept in document order
                    last = pt.word_of[c.pos]
                    self.spans.append((c.start_word, last))
                    self.cursor, self._cands, self.phase = last + 1, [], "line"
                    return
            else:
                cands = [
                    _Cand(
                        c.pos + 1,
                        c.start_word,
                        c.n_words + (pt.word_of[c.pos + 1] != pt.word_of[c.pos]),
                    )
                    for c in self._cands
                    if not self._forced_end(c) and pt.token_ids[c.pos + 1] == token_id
                ]
                if cands:
                    self._cands = cands
                    return
        self.n_generated -= 1
        raise ValueError(f"token {token_id} not allowed in phase {self.phase!r}")

    def char_spans(self) -> list[tuple[int, int]]:
        """Char offsets ``(start, end)`` of the finished spans in the passage text."""
        return [self.passage.words.char_span(a, b) for a, b in self.spans]

    def max_new_tokens(self) -> int:
        """An upper bound on the answer's length: every passage token once, plus the markup."""
        return len(self.passage.token_ids) + 2 * self.max_nuggets + 1
