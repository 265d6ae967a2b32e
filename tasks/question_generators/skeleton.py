"""The JSON-array skeleton constraint of the local question generator.

The packaged SmolLM2-135M-Instruct is too weak to write free JSON, so the structure is forced:
the answer is decoded under a constraint (:class:`SkeletonMachine`) that emits ``["`` first,
then lets the model write question text (the first token is the start of a question word such
as ``What`` / ``How`` / ``Can``, then no ``"``, ``\\``, control characters or ``?`` inside), ends
a question at a token ending with ``?`` (allowed after ``min_question_tokens`` with a logit bonus
growing with the length, forced at ``max_question_tokens``), emits ``", "`` between questions and
``"]`` after the ``n``-th. The output always parses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch


@dataclass(frozen=True)
class SkeletonVocab:
    """Token classes of one tokenizer for the JSON-array skeleton.

    ``text``: ``(vocab,)`` bool, tokens allowed inside a question (no ``" \\ ?``, no control
    character, no broken UTF-8, not special); ``close``: tokens that end a question (end with
    ``?``, one ``?``, otherwise like ``text``). ``open`` / ``sep`` / ``end``: the token ids of
    ``["``, ``", "`` and ``"]``; ``qmark``: ``?``; ``eos``: end of the assistant turn;
    ``start``: the first tokens of :data:`QUESTION_STARTERS` (a question's first token).
    """

    text: torch.Tensor
    close: torch.Tensor
    start: torch.Tensor
    open: tuple[int, ...]
    sep: tuple[int, ...]
    end: tuple[int, ...]
    qmark: int
    eos: int


# A question's first token is one of these words' first tokens: the 135M model left free starts
# with list numbers, "Document:" or copies of the passage; with them it writes questions.
QUESTION_STARTERS = (
    "What", "Who", "When", "Where", "Which", "Why", "How", "Can", "Could", "In", "According",
)  # fmt: skip


def _bad_char(s: str) -> bool:
    return any(c in '"\\\ufffd' or ord(c) < 32 or ord(c) == 127 for c in s)


@lru_cache(maxsize=4)
def _skeleton_vocab_cached(tokenizer: Any) -> SkeletonVocab:
    vocab = len(tokenizer)
    special = set(int(i) for i in tokenizer.all_special_ids)
    text = torch.zeros(vocab, dtype=torch.bool)
    close = torch.zeros(vocab, dtype=torch.bool)
    for i in range(vocab):
        if i in special:
            continue
        s = tokenizer.decode([i])
        if not s or _bad_char(s):
            continue
        if "?" not in s:
            text[i] = True
        elif s.endswith("?") and s.count("?") == 1:
            close[i] = True

    def enc(piece: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(piece, add_special_tokens=False))

    qmark = enc("?")
    if len(qmark) != 1:
        raise ValueError("the tokenizer does not encode '?' as one token")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos is None or eos == tokenizer.unk_token_id:
        eos = tokenizer.eos_token_id
    start = torch.zeros(vocab, dtype=torch.bool)
    for word in QUESTION_STARTERS:
        first = enc(word)[0]
        if text[first]:
            start[first] = True
    return SkeletonVocab(text, close, start, enc('["'), enc('", "'), enc('"]'), qmark[0], int(eos))


def skeleton_vocab(tokenizer: Any) -> SkeletonVocab:
    """The (cached) :class:`SkeletonVocab` of a tokenizer."""
    return _skeleton_vocab_cached(tokenizer)


@dataclass
class SkeletonMachine:
    """The constraint for one answer: ``["q1?", "q2?", ... "qn?"]`` then EOS.

    Per step: :meth:`forced` is the one token that must come next (skeleton), or None when the
    model chooses among :meth:`allowed` (a bool mask over the vocabulary); then
    :meth:`advance`. Every path ends after at most ``n * (max_question_tokens + len(sep)) +
    len(open) + len(end) + 1`` tokens.
    """

    sv: SkeletonVocab
    n: int
    min_question_tokens: int
    max_question_tokens: int
    queue: list[int] = field(default_factory=list)
    questions: int = 0
    q_tokens: int = 0
    done: bool = False
    generated: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.queue = list(self.sv.open)

    def forced(self) -> int | None:
        if self.done:
            return self.sv.eos
        if self.queue:
            return self.queue[0]
        if self.q_tokens >= self.max_question_tokens:
            return self.sv.qmark
        return None

    def allowed(self) -> torch.Tensor:
        if self.q_tokens == 0:
            return self.sv.start
        if self.q_tokens < self.min_question_tokens:
            return self.sv.text
        return self.sv.text | self.sv.close

    def close_boost(self, per_token: float) -> float:
        """Logit bonus of the closing tokens: ``per_token`` per token beyond the minimum."""
        return max(0, self.q_tokens - self.min_question_tokens) * per_token

    def logit_bonus(self, per_token: float) -> torch.Tensor | None:
        """``(vocab,)`` bonus added to the logits before sampling: :meth:`close_boost` on the
        closing tokens (None when it is 0)."""
        boost = self.close_boost(per_token)
        return self.sv.close.float() * boost if boost else None

    def advance(self, token: int) -> None:
        if self.done:
            return
        self.generated.append(int(token))
        if self.queue:
            if token != self.queue[0]:
                raise ValueError(f"token {token} is not the forced {self.queue[0]}")
            self.queue.pop(0)
            if not self.queue and self.questions == self.n:
                self.queue = []
                self.done = True
                self.generated.append(self.sv.eos)
            return
        if token == self.sv.qmark or bool(self.sv.close[token]):
            self.questions += 1
            self.q_tokens = 0
            self.queue = list(self.sv.end if self.questions == self.n else self.sv.sep)
            return
        if not bool(self.sv.text[token]):
            raise ValueError(f"token {token} is not allowed inside a question")
        self.q_tokens += 1

    def max_new_tokens(self) -> int:
        sk = len(self.sv.open) + len(self.sv.end) + 1
        return self.n * (self.max_question_tokens + 1 + len(self.sv.sep)) + sk
