"""Nugget extraction with a local causal LM under constrained decoding (backend ``"local"``).

A small model (default: the packaged SmolLM2-135M-Instruct) cannot be trusted to write JSON or to
copy text exactly, so it is never asked to: it is run greedily under a constraint that lets it
only copy runs of the passage's own tokens. The model only chooses where each span starts, where
it stops, and when the list ends; every candidate is verbatim by construction.

The assistant answer is a list, one span per line::

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

Two drivers make the same greedy choices, ``batch_size`` passages at a time (left-padded):
``driver="jump"`` (default) is a loop over one KV cache that feeds every forced token (inside a
word, between two places to stop) in the same forward pass ("jump-forward") and runs the model
only where there is a choice; ``driver="generate"`` is ``model.generate`` with the
constraint as a ``LogitsProcessor``, one forward pass per token (the reference).
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from inference.llm_client import CallRecord
from schemas.keys import fingerprint, sha256_hex
from tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    ResultFn,
    ResultReporter,
)
from tasks.extractors.rules import WordSpans, merge_short, runs_after, segment_words

log = logging.getLogger(__name__)

LOCAL_SYSTEM_PROMPT = (
    "You copy facts from a passage for a search index. List the passage's key facts, one per "
    'line, each line starting with "- ". Each fact is a short phrase or clause copied word for '
    "word from the passage."
)
LOCAL_USER_TEMPLATE = "Passage:\n{text}"
LOCAL_PROMPT_VERSION = (
    "pl-" + sha256_hex("local-prompt", LOCAL_SYSTEM_PROMPT, LOCAL_USER_TEMPLATE)[:12]
)
DECODING = "greedy-constrained-v2"  # bump when the constraint's rules change


def build_local_messages(text: str) -> list[dict[str, str]]:
    """Chat messages of the local prompt for one passage (the answer is the constrained list)."""
    return [
        {"role": "system", "content": LOCAL_SYSTEM_PROMPT},
        {"role": "user", "content": LOCAL_USER_TEMPLATE.format(text=text)},
    ]


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


# ---------------------------------------------------------------------------------------------
# Drivers


def _masked_argmax(logits: Any, allowed: list[int]) -> int:
    """Greedy choice among ``allowed`` from one row of logits (shape ``[vocab]``)."""
    if len(allowed) == 1:
        return allowed[0]
    sub = logits[allowed]
    return allowed[int(sub.argmax())]


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[Any, Any]:
    """Token ids ``[B, max P]`` and attention mask ``[B, max P]`` of left-padded prompts."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


@dataclass
class PromptPrefix:
    """The KV cache of the token ids every prompt starts with (system turn, ``"Passage:"``).

    ``cache`` holds ``ids`` for batch 1 (per layer ``[1, kv_heads, len(ids), head_dim]``);
    :func:`run_jump_forward` copies it to the batch size instead of recomputing it.
    """

    ids: list[int]
    cache: Any

    @classmethod
    def compute(cls, model: Any, ids: list[int]) -> PromptPrefix:
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache)
        return cls(list(ids), cache)


def run_jump_forward(
    model: Any,
    prompts: list[list[int]],
    machines: list[SpanCopyMachine],
    pad: int,
    prefix: PromptPrefix | None = None,
) -> None:
    """Greedy constrained decoding of B passages over one KV cache, forced tokens fed in bulk.

    ``prompts``: B chat prompts (token ids), prefilled left-padded as ``[B, max P]``; with a
    ``prefix`` that every prompt starts with, its cache is copied to the batch and only the rest
    is prefilled, as ``[B, max P - len(prefix)]`` (the padding then sits between the prefix and
    the rest, masked out). Then each step: every row picks its token from its logits
    (``[B, vocab]``, the last position only), adds every following token that has no alternative
    (inside a word, between two places to stop), and the rows' tokens are fed together as
    ``[B, k]``, each row left-padded to the longest (``k``); pad positions are masked out of
    attention and never read. A row whose machine is done leaves the batch
    (``cache.batch_select_indices``). With B = 1 this is plain jump-forward decoding; the choices
    equal those of :func:`run_generate`.
    """
    import copy

    import torch
    from transformers import DynamicCache

    device = model.device
    if prefix is not None and all(p[: len(prefix.ids)] == prefix.ids for p in prompts):
        start = len(prefix.ids)
        cache = copy.deepcopy(prefix.cache)
        cache.batch_repeat_interleave(len(prompts))
    else:
        start, cache = 0, DynamicCache()
    ids, mask = _left_pad([p[start:] for p in prompts], pad)
    positions = start + (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P - start]
    if start:
        mask = torch.cat([torch.ones((len(prompts), start), dtype=torch.long), mask], dim=-1)
    n_real = mask.sum(-1)  # [B] real tokens per row so far
    active = list(range(len(prompts)))  # machine index of each cache row
    with torch.inference_mode():
        logits = (
            model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )  # [B, vocab]
        while True:
            pending: list[list[int]] = []
            for row, i in enumerate(active):
                m = machines[i]
                tok = _masked_argmax(logits[row], m.allowed())
                m.advance(tok)
                run = [tok]
                while not m.done and len(allowed := m.allowed()) == 1:
                    m.advance(allowed[0])
                    run.append(allowed[0])
                pending.append(run)
            keep = [row for row, i in enumerate(active) if not machines[i].done]
            if not keep:
                return
            if len(keep) < len(active):
                sel = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(sel.to(device))
                mask, n_real = mask[sel], n_real[sel]
                active = [active[r] for r in keep]
                pending = [pending[r] for r in keep]
            k = max(len(run) for run in pending)
            step_ids = torch.full((len(active), k), pad, dtype=torch.long)
            step_mask = torch.zeros((len(active), k), dtype=torch.long)
            for row, run in enumerate(pending):
                step_ids[row, k - len(run) :] = torch.tensor(run, dtype=torch.long)
                step_mask[row, k - len(run) :] = 1
            step_pos = n_real[:, None] + (step_mask.cumsum(-1) - 1).clamp(min=0)  # [B, k]
            mask = torch.cat([mask, step_mask], dim=-1)  # [B, past + k]
            n_real = n_real + step_mask.sum(-1)
            logits = (
                model(
                    input_ids=step_ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=step_pos.to(device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1]
                .float()
            )


def _constraint_processor(machines: list[SpanCopyMachine], prompt_len: int) -> Any:
    """A ``LogitsProcessor`` for ``generate`` that masks each row's scores to its machine's tokens.

    ``input_ids``: ``[B, P + t]`` (left-padded prompts and the ``t`` tokens generated so far);
    ``scores``: ``[B, vocab]``. The tokens appended since the previous call go to the machines.
    (Built here so that importing this module does not import transformers.)
    """
    import torch
    from transformers import LogitsProcessor

    class ConstraintProcessor(LogitsProcessor):
        def __init__(self) -> None:
            self.seen = prompt_len

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            cur = input_ids.shape[1]
            for p in range(self.seen, cur):
                for row, m in enumerate(machines):
                    m.advance(int(input_ids[row, p]))
            self.seen = cur
            keep = torch.zeros_like(scores, dtype=torch.bool)
            for row, m in enumerate(machines):
                keep[row, m.allowed()] = True
            return scores.masked_fill(~keep, float("-inf"))

    return ConstraintProcessor()


def run_generate(
    model: Any, prompts: list[list[int]], machines: list[SpanCopyMachine], pad: int
) -> None:
    """Greedy constrained decoding of B passages in one ``model.generate`` call: the reference.

    ``prompts``: B token-id lists, fed left-padded as ``[B, max P]`` with a ``[B, max P]`` mask;
    the constraint is a ``LogitsProcessor``. One forward pass per generated token.
    """
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    ids, mask = _left_pad(prompts, pad)
    width = ids.shape[1]
    config = GenerationConfig(
        max_new_tokens=max(m.max_new_tokens() for m in machines),
        do_sample=False,
        eos_token_id=machines[0].special.eos,
        pad_token_id=pad,
    )
    proc = _constraint_processor(machines, width)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([proc]),
        )
    # feed the last sampled token (generate does not call the processor after it)
    for p in range(proc.seen, out.shape[1]):
        for row, m in enumerate(machines):
            m.advance(int(out[row, p]))


# ---------------------------------------------------------------------------------------------
# The extractor


_DRIVERS = ("jump", "generate")


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer encodes {text!r} as {len(ids)} tokens; need exactly 1")
    return int(ids[0])


class LocalConstrainedExtractor:
    """Verbatim nugget spans chosen by a local causal LM under constrained decoding.

    Options: ``model`` (a reference for ``inference.models.load_model``; None = packaged
    SmolLM2-135M-Instruct; or an already loaded ``LoadedModel``), spans of
    ``min_words..max_words`` words, at most ``max(max_nuggets, ceil(spans_per_head * heads))``
    per passage (``heads``: its clauses with a place to start, each of which gets a span of at
    least ``min_head_words`` words unless the clause is shorter), ``device``, ``batch_size``
    (passages decoded together), ``driver`` (``"jump"`` or ``"generate"``; same output),
    ``boundaries`` (``"clause"`` or ``"word"``: where spans may start and stop by choice, see
    :func:`tokenize_passage`). The model is loaded on first use.

    One ``CallRecord`` per passage: ``tokens_in`` = prompt tokens, ``tokens_out`` = generated
    tokens (through end-of-turn), cost 0, ``latency_ms`` = the wall time of the call that served
    it divided by the passages in that call.
    """

    backend = "local"
    stage_answers = True
    prompt_version = LOCAL_PROMPT_VERSION

    def __init__(
        self,
        model: Any = None,
        *,
        max_nuggets: int = 8,
        min_words: int = 3,
        max_words: int = 25,
        min_head_words: int = 8,
        spans_per_head: float = 1.5,
        device: str = "cpu",
        batch_size: int = 4,
        driver: str = "jump",
        boundaries: str = "clause",
    ) -> None:
        if not 1 <= min_words <= max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
        if max_nuggets < 1 or batch_size < 1:
            raise ValueError(
                f"max_nuggets ({max_nuggets}) and batch_size ({batch_size}) must be >= 1"
            )
        if min_head_words < 1 or spans_per_head < 1.0:
            raise ValueError(
                f"need min_head_words >= 1 and spans_per_head >= 1, got {min_head_words}, "
                f"{spans_per_head}"
            )
        self.model_ref = model
        self.max_nuggets = max_nuggets
        self.min_words = min_words
        self.max_words = max_words
        self.min_head_words = min_head_words
        self.spans_per_head = spans_per_head
        self.device = device
        self.batch_size = batch_size
        if driver not in _DRIVERS:
            raise ValueError(f"driver={driver!r}: expected one of {sorted(_DRIVERS)}")
        self.driver = driver
        if boundaries not in BOUNDARIES:
            raise ValueError(f"boundaries={boundaries!r}: expected one of {BOUNDARIES}")
        self.boundaries = boundaries
        self._loaded: Any = None if model is None or isinstance(model, str | os.PathLike) else model
        self._prefix: PromptPrefix | None = None
        self._model_fp: str | None = None

    @property
    def loaded(self) -> Any:
        """The ``LoadedModel`` (loaded on first access)."""
        if self._loaded is None:
            from inference.models import load_shared_model

            # Shared with the KV stage of the same build: one copy of the weights per process.
            ref = None if self.model_ref is None else str(self.model_ref)
            self._loaded = load_shared_model(ref, self.device)
        return self._loaded

    @property
    def model_fp(self) -> str:
        """The model's fingerprint, computed without loading the weights when not loaded yet.

        Same recipe as ``inference.models.load_model`` (config, weights hash, dtype, tokenizer):
        asking which chunks are already extracted must not cost a model load.
        """
        if self._loaded is not None:
            return self._loaded.model_fp
        if self._model_fp is None:
            from inference.models import reference_model_fingerprint

            self._model_fp = reference_model_fingerprint(self.model_ref, self.device)
        return self._model_fp

    @property
    def llm_model(self) -> str:  # type: ignore[override]
        """``<model name>@<model_fp>``, e.g. ``smollm2@model-7c24d0836faf1727``."""
        ref = self.model_ref
        name = "smollm2" if ref is None else getattr(ref, "model_dir", ref)
        return f"{os.path.basename(str(name))}@{self.model_fp}"

    @property
    def fingerprint(self) -> str:
        return fingerprint(
            "extractor",
            {
                "backend": self.backend,
                "model_fp": self.model_fp,
                "prompt_version": LOCAL_PROMPT_VERSION,
                "min_words": self.min_words,
                "max_words": self.max_words,
                "max_nuggets": self.max_nuggets,
                "min_head_words": self.min_head_words,
                "spans_per_head": self.spans_per_head,
                "boundaries": self.boundaries,
                "decoding": DECODING,
            },
        )

    def _special(self) -> SpecialIds:
        tok = self.loaded.tokenizer
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        if eos is None or eos == tok.unk_token_id:
            eos = tok.eos_token_id
        return SpecialIds(_single_token(tok, "-"), _single_token(tok, "\n"), int(eos))

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of the chat prompt for one passage, ending with the assistant header."""
        tok = self.loaded.tokenizer
        prompt = tok.apply_chat_template(
            build_local_messages(text), add_generation_prompt=True, tokenize=False
        )
        return tok(prompt, add_special_tokens=False)["input_ids"]

    def _prompt_prefix(self) -> PromptPrefix:
        """The KV of the prompt part shared by every passage, computed once."""
        if self._prefix is None:
            a, b = self.prompt_ids("x"), self.prompt_ids("Zebra 1927 über")
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
            # one token less: the last shared token could merge with a passage's first characters
            self._prefix = PromptPrefix.compute(self.loaded.model, a[: max(n - 1, 0)])
        return self._prefix

    def budget(self, n_heads: int) -> int:
        """Spans a passage with ``n_heads`` clause heads may get: ``max_nuggets`` at least, and
        room for every head plus ``spans_per_head - 1`` spans of the model's choice per head.

        >>> ex = LocalConstrainedExtractor(max_nuggets=8)
        >>> ex.budget(3), ex.budget(20)
        (8, 30)
        """
        return max(self.max_nuggets, math.ceil(self.spans_per_head * n_heads - 1e-9))

    def machine(self, text: str) -> SpanCopyMachine:
        """A fresh constraint for one passage."""
        pt = tokenize_passage(text, self.loaded.tokenizer, self.min_words, self.boundaries)
        return SpanCopyMachine(
            pt,
            self._special(),
            self.budget(len(pt.heads)),
            self.min_words,
            self.max_words,
            self.min_head_words,
        )

    def spans(self, texts: Sequence[str]) -> list[list[str]]:
        """Candidates for each text (no ledger): verbatim substrings in document order."""
        reqs = [ExtractionRequest(str(i), t) for i, t in enumerate(texts)]
        return [r.candidates for r in self.extract(reqs)]

    def _run(self, texts: list[str]) -> tuple[list[SpanCopyMachine], list[int], float]:
        from inference.rope import reset_rotary

        machines = [self.machine(t) for t in texts]
        prompts = [self.prompt_ids(t) for t in texts]
        t0 = time.perf_counter()
        tok, model = self.loaded.tokenizer, self.loaded.model
        reset_rotary(model)  # the model is shared with the KV stage: no grown dynamic-NTK state
        pad = tok.pad_token_id if tok.pad_token_id is not None else machines[0].special.eos
        if self.driver == "jump":
            run_jump_forward(model, prompts, machines, pad, prefix=self._prompt_prefix())
        else:
            run_generate(model, prompts, machines, pad)
        return machines, [len(p) for p in prompts], time.perf_counter() - t0

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One result per request, in order. Passages are batched by similar length.

        A model that cannot be loaded raises (a setting to fix, not a bad chunk); a failure while
        decoding a batch is retried passage by passage and then recorded as ``failed``.
        """
        if requests:
            self.loaded  # noqa: B018 - load (or fail) once, before any chunk is attempted
        results: dict[int, ExtractionResult] = {}
        report = ResultReporter(on_result)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].text))
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            started = datetime.now(UTC)
            try:
                machines, n_in, wall = self._run([requests[i].text for i in idx])
            except Exception as exc:  # noqa: BLE001 - retry one by one, then record the failure
                if len(idx) > 1:
                    log.warning("local extraction batch failed (%s); retrying one by one", exc)
                    for i in idx:
                        results[i] = self._one(requests[i])
                else:
                    results[idx[0]] = self._failed(requests[idx[0]], started, exc)
            else:
                for i, m, p_len in zip(idx, machines, n_in, strict=True):
                    req = requests[i]
                    results[i] = ExtractionResult(
                        req.key,
                        "ok",
                        [req.text[s:e] for s, e in m.char_spans()],
                        calls=[self._record(req, started, p_len, m.n_generated, wall / len(idx))],
                    )
            for i in idx:
                report(results[i])
        return [results[i] for i in range(len(requests))]

    def _one(self, req: ExtractionRequest) -> ExtractionResult:
        started = datetime.now(UTC)
        try:
            (m,), (p_len,), wall = self._run([req.text])
        except Exception as exc:  # noqa: BLE001
            return self._failed(req, started, exc)
        cands = [req.text[s:e] for s, e in m.char_spans()]
        rec = self._record(req, started, p_len, m.n_generated, wall)
        return ExtractionResult(req.key, "ok", cands, calls=[rec])

    def _record(
        self, req: ExtractionRequest, started: datetime, n_in: int, n_out: int, wall_s: float
    ) -> CallRecord:
        return CallRecord(
            call_id=f"call-{uuid.uuid4().hex[:16]}",
            key=req.key,
            attempt=1,
            status="ok",
            tokens_in=n_in,
            tokens_out=n_out,
            cost_usd=0.0,
            latency_ms=wall_s * 1000.0,
            started_at=started,
        )

    def _failed(
        self, req: ExtractionRequest, started: datetime, exc: Exception
    ) -> ExtractionResult:
        error = f"{type(exc).__name__}: {exc}"
        rec = CallRecord(
            call_id=f"call-{uuid.uuid4().hex[:16]}",
            key=req.key,
            attempt=1,
            status="error",
            tokens_in=0,
            tokens_out=0,
            cost_usd=0.0,
            latency_ms=(datetime.now(UTC) - started).total_seconds() * 1000.0,
            started_at=started,
            error=error,
        )
        return ExtractionResult(req.key, "failed", error=error, calls=[rec])
