"""Self-study data for cartridges: synthetic questions about each document, and the teacher's
answers with its top-k log-probabilities (CAS appendix I; Cartridges, Eyuboglu et al. 2025).

Questions
---------
A question generator gets a document (or a slice of a long one) and a seed type and returns
``n`` (20) questions per call as a JSON array of strings. Seed types: ``structuring`` (organise
facts as JSON / YAML / a table), ``summarization``, ``question`` (factual recall and reasoning),
``use_case`` (downstream tasks), ``creative`` (open discussion). Calls are planned by
:func:`plan_calls`: every document gets ``min_calls_per_doc`` calls and the remaining calls are
drawn with probability proportional to document length (seeded), each with a uniformly drawn seed
type and, for a document longer than ``max_slice_chars``, a random slice. A call is cached by
``(generator_fp, text_hash of the text it saw, seed type, call index)`` (``SelfStudyCallRow``),
so a rerun makes no call. An answer that is not a JSON array of strings is dropped and counted
(``status="malformed"``, cached, not retried); items that are not usable questions (not a string,
fewer than ``min_words`` words, duplicates, no content word of the document) are dropped and
counted per call (``n_raw - n_questions``).

Backends:

- ``openai`` (:class:`OpenAIQuestionGenerator`): chat completions on api.openai.com or any
  compatible endpoint, through the helpers of ``tasks/extractors/openai_chat.py`` (client without
  its own retries, retries with backoff and ``Retry-After``, fatal errors stop the run, secrets
  scrubbed); every HTTP attempt is a ledger row (``extraction_calls``, backend
  ``selfstudy-openai``).
- ``local`` (:class:`LocalQuestionGenerator`): the packaged SmolLM2-135M-Instruct is too weak to
  write free JSON, so the structure is forced: the answer is decoded under a constraint that
  emits ``["`` first, then lets the model write question text (sampling; the first token is
  the start of a question word such as ``What`` / ``How`` / ``Can``, then no ``"``, ``\\``,
  control characters or ``?`` inside), ends a question at a token ending with ``?`` (allowed
  after ``min_question_tokens`` with a logit bonus growing with the length, forced at
  ``max_question_tokens``), emits ``", "`` between questions and ``"]`` after the ``n``-th. The
  output always parses; usability is measured by the same filter as the OpenAI path.

Teacher
-------
The target model answers every question with the document in context, in the project's RAG
prompt (``prefix_ids + doc_ids + query_ids(question)``, ``inference/prompt.py``): greedy, at most
``max_new_tokens`` tokens, ending with its EOS token when it stops. Per answer position the
teacher's top-k (k = 20) log-softmax values and ids are kept (``TeacherAnswerRow``), cached by
``(teacher_fp, context_hash, question_id)``. The document's KV is computed once and the questions
of a document are answered in batches (left-padded between the document and the question, with
the padding masked and positions kept contiguous).
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

import pyarrow.compute as pc
import torch

from inference.generate import _eos_ids
from inference.prompt import RagPrompt
from schemas.keys import CODE_VERSION, fingerprint, sha256_hex, text_hash
from schemas.tables import (
    DocumentRow,
    SelfStudyCallRow,
    SelfStudyQuestionRow,
    TeacherAnswerRow,
)
from storage.store import Store
from storage.tables import append_rows, read_rows
from tasks.extract import ledger_row
from tasks.extractors.base import CallRecord
from tasks.extractors.openai_chat import (
    _content_of,
    backoff_delay,
    chat_call_record,
    classify_error,
    describe_error,
    known_secrets,
    make_client,
    new_call_id,
    retry_after_seconds,
    scrub,
)
from tasks.extractors.prompt import MalformedResponse

log = logging.getLogger(__name__)

SEED_TYPES = ("structuring", "summarization", "question", "use_case", "creative")

_SEED_TASKS = {
    "structuring": (
        "requests that ask to organise specific information from the document into a structured "
        "format such as JSON, YAML, a table or a list; name the facts, entities or sections"
    ),
    "summarization": (
        "requests that ask to summarise a specific part, aspect or section of the document; "
        "say precisely which part"
    ),
    "question": (
        "questions that test knowledge of the information in the document; each covers a "
        "different fact, detail or aspect; mix factual recall, comparison, reasoning and "
        "detail-oriented questions; include specific details (numbers, names, titles, dates, "
        "values) so that it is clear what is asked"
    ),
    "use_case": (
        "practical tasks a user could ask an assistant to do with the information in the "
        "document, each grounded in specific details of it"
    ),
    "creative": (
        "open-ended, creative prompts for discussion that are grounded in specific details of "
        "the document"
    ),
}
SYSTEM_TEMPLATE = "You write diverse questions about a document.\n\nDocument:\n{text}"
USER_TEMPLATE = (
    "Generate {n} diverse {task}. Output only one JSON array of strings, for example "
    '["Question 1", "Question 2", ...]. No other text, no markdown fences, no explanations.'
)
LOCAL_SYSTEM = "You write questions about a document."
LOCAL_USER_TEMPLATE = "Document:\n{text}\n\nWrite {n} different {task}, as a JSON list."
PROMPT_VERSION = (
    "qp-"
    + sha256_hex(
        "qgen",
        SYSTEM_TEMPLATE,
        USER_TEMPLATE,
        LOCAL_SYSTEM,
        LOCAL_USER_TEMPLATE,
        json.dumps(_SEED_TASKS),
    )[:12]
)

_STOPWORDS = frozenset(
    "about above after again also among been before being below between both could does doing "
    "during each from further have having here into itself more most other over same should some "
    "such than that their them then there these they this those through under until very what "
    "when where which while whom will with would your yours list write give describe explain "
    "document text information".split()
)
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'-]*")


def build_question_messages(text: str, seed_type: str, n: int) -> list[dict[str, str]]:
    """Chat messages of one question-generation call (OpenAI backend)."""
    return [
        {"role": "system", "content": SYSTEM_TEMPLATE.format(text=text)},
        {"role": "user", "content": USER_TEMPLATE.format(n=n, task=_SEED_TASKS[seed_type])},
    ]


def build_local_messages(text: str, seed_type: str, n: int) -> list[dict[str, str]]:
    """Chat messages of one call of the local generator (shorter: a 135M model)."""
    return [
        {"role": "system", "content": LOCAL_SYSTEM},
        {
            "role": "user",
            "content": LOCAL_USER_TEMPLATE.format(
                text=text, n=n, task=_SEED_TASKS[seed_type].split(";")[0]
            ),
        },
    ]


# ---------------------------------------------------------------------------- parsing


class MalformedQuestions(ValueError):
    """The generator's answer is not a JSON array of strings."""


def parse_questions(content: str | None) -> list[Any]:
    """The items of a JSON array answer (a ```json fence around it is tolerated; an object with
    one list value, as ``json_object`` mode returns, too).

    >>> parse_questions('["Who?", "When?"]')
    ['Who?', 'When?']
    """
    if content is None or not content.strip():
        raise MalformedQuestions("empty answer")
    text = content.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    if fence:
        text = fence.group(1)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedQuestions(f"not JSON: {exc}") from None
    if isinstance(value, dict):
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise MalformedQuestions("a JSON object without exactly one list value")
        value = lists[0]
    if not isinstance(value, list):
        raise MalformedQuestions(f"a JSON {type(value).__name__}, not an array")
    return value


def content_words(text: str) -> set[str]:
    """Lower-cased words of 4+ characters that are not stopwords."""
    return {w.lower() for w in _WORD.findall(text) if len(w) >= 4} - _STOPWORDS


def usable_questions(
    items: Sequence[Any], doc_text: str, min_words: int = 3, max_words: int = 80
) -> tuple[list[str], dict[str, int]]:
    """The usable questions among ``items`` and the count of drops per reason.

    Usable: a string of ``min_words..max_words`` words (whitespace collapsed), not a
    case-insensitive duplicate of an earlier one, sharing a content word with the document.
    """
    kept: list[str] = []
    seen: set[str] = set()
    drops: dict[str, int] = {}
    vocab = content_words(doc_text)

    def drop(reason: str) -> None:
        drops[reason] = drops.get(reason, 0) + 1

    for item in items:
        if not isinstance(item, str):
            drop("not_string")
            continue
        q = " ".join(item.split())
        n = len(q.split())
        if n < min_words:
            drop("too_short")
        elif n > max_words:
            drop("too_long")
        elif q.lower() in seen:
            drop("duplicate")
        elif not content_words(q) & vocab:
            drop("off_document")
        else:
            seen.add(q.lower())
            kept.append(q)
    return kept, drops


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class CallPlan:
    """One planned generator call: which text it sees and with which seed."""

    doc_id: str
    doc_version: str
    text: str  # the document or a slice of it
    char_start: int
    char_end: int
    seed_type: str
    call_index: int  # ordinal among the plan's calls of the same (text, seed type)

    @property
    def text_hash(self) -> str:
        return text_hash(self.text)


def call_key(generator_fp: str, plan: CallPlan) -> str:
    """The cache key of a call: ``hash(generator_fp, text_hash, seed_type, call_index)``."""
    return (
        "sq-"
        + sha256_hex(
            "selfstudy-call", generator_fp, plan.text_hash, plan.seed_type, str(plan.call_index)
        )[:24]
    )


def _slice(text: str, max_chars: int, rng: random.Random) -> tuple[int, int]:
    if len(text) <= max_chars:
        return 0, len(text)
    start = rng.randrange(0, len(text) - max_chars + 1)
    # widen to word boundaries inside the limit
    if start > 0:
        space = text.find(" ", start)
        start = space + 1 if 0 <= space < start + 50 else start
    end = min(len(text), start + max_chars)
    if end < len(text):
        space = text.rfind(" ", start, end)
        end = space if space > start else end
    return start, end


def plan_calls(
    docs: Sequence[DocumentRow],
    *,
    seed: int = 0,
    n_calls: int | None = None,
    chars_per_call: int = 2000,
    min_calls_per_doc: int = 1,
    max_slice_chars: int = 12000,
    seed_types: Sequence[str] = SEED_TYPES,
) -> list[CallPlan]:
    """The seeded plan of generator calls for ``docs``.

    ``n_calls`` defaults to ``max(min_calls_per_doc * len(docs), total_chars / chars_per_call)``.
    Each document gets ``min_calls_per_doc`` calls; the others are drawn with probability
    proportional to the document's length. E.g. two documents of 1,000 and 3,000 chars and
    ``n_calls=6``: 1 + 1 guaranteed, the other 4 land on the long one ~3 times out of 4.
    """
    for s in seed_types:
        if s not in _SEED_TASKS:
            raise ValueError(f"unknown seed type {s!r} (known: {', '.join(SEED_TYPES)})")
    docs = sorted(docs, key=lambda d: d.doc_id)
    if not docs:
        return []
    total = sum(len(d.text) for d in docs)
    if n_calls is None:
        n_calls = max(min_calls_per_doc * len(docs), round(total / max(chars_per_call, 1)))
    rng = random.Random(seed)
    picks = [d for d in docs for _ in range(min_calls_per_doc)]
    extra = n_calls - len(picks)
    if extra > 0:
        picks += rng.choices(docs, weights=[max(len(d.text), 1) for d in docs], k=extra)
    plans: list[CallPlan] = []
    counter: dict[tuple[str, str], int] = {}
    for d in picks:
        seed_type = rng.choice(list(seed_types))
        start, end = _slice(d.text, max_slice_chars, rng)
        text = d.text[start:end]
        key = (text_hash(text), seed_type)
        index = counter.get(key, 0)
        counter[key] = index + 1
        plans.append(CallPlan(d.doc_id, d.doc_version, text, start, end, seed_type, index))
    return plans


# ---------------------------------------------------------------------------- generators


@dataclass(frozen=True)
class QuestionRequest:
    """One call to make: ``key`` is its call key."""

    key: str
    text: str
    seed_type: str
    call_index: int


@dataclass
class QuestionResult:
    """The outcome of one call: raw items (``ok``), a malformed answer, or a failure."""

    key: str
    status: str  # ok | malformed | failed
    items: list[Any] = field(default_factory=list)
    error: str | None = None
    calls: list[CallRecord] = field(default_factory=list)


def generator_fingerprint(backend: str, fields: dict[str, Any]) -> str:
    """Fingerprint of a question generator (no key, no URL)."""
    return fingerprint("qgen", {"backend": backend, "prompt_version": PROMPT_VERSION, **fields})


class OpenAIQuestionGenerator:
    """Questions from chat completions (GPT-4o-mini or any OpenAI-compatible endpoint)."""

    backend = "openai"

    def __init__(
        self,
        model: str = "gpt-4o-mini",
        *,
        client: Any = None,
        base_url: str | None = None,
        api_key: str | None = None,
        n_questions: int = 20,
        temperature: float = 1.0,
        concurrency: int = 8,
        max_attempts: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        retry_after_max_s: float = 300.0,
        timeout_s: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if max_attempts < 1 or concurrency < 1:
            raise ValueError("max_attempts and concurrency must be >= 1")
        self.llm_model = model
        self.n_questions = n_questions
        self.temperature = temperature
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.retry_after_max_s = retry_after_max_s
        self._client = make_client(client, base_url=base_url, api_key=api_key, timeout_s=timeout_s)
        self._secrets = known_secrets(self._client) + ((api_key,) if api_key else ())
        self._sleep = sleep
        self._rng = random.Random()
        self._fatal: str | None = None
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        return generator_fingerprint(
            self.backend,
            {"model": self.llm_model, "n": self.n_questions, "temperature": self.temperature},
        )

    def generate(self, requests: Sequence[QuestionRequest]) -> list[QuestionResult]:
        """One result per request, in order; never raises for one bad call."""
        self._fatal = None

        def run(req: QuestionRequest) -> QuestionResult:
            try:
                return self._one(req)
            except Exception as exc:  # noqa: BLE001 - one call must not sink the run
                return QuestionResult(req.key, "failed", error=describe_error(exc, self._secrets))

        if not requests:
            return []
        workers = min(self.concurrency, len(requests))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="selfstudy") as pool:
            return list(pool.map(run, requests))

    def _record(
        self, req: QuestionRequest, attempt: int, status: str, started: datetime, t0: float,
        tokens_in: int = 0, tokens_out: int = 0, error: str | None = None,
    ) -> CallRecord:  # fmt: skip
        return chat_call_record(
            req.key, self.llm_model, attempt, status, started, t0, tokens_in, tokens_out, error
        )

    def _one(self, req: QuestionRequest) -> QuestionResult:
        calls: list[CallRecord] = []
        messages = build_question_messages(req.text, req.seed_type, self.n_questions)
        attempt = 0
        while True:
            if self._fatal is not None:
                return QuestionResult(
                    req.key, "failed", error=f"aborted: {self._fatal}", calls=calls
                )
            attempt += 1
            started, t0 = datetime.now(UTC), time.perf_counter()
            try:
                completion = self._client.chat.completions.create(
                    model=self.llm_model, messages=messages, temperature=self.temperature
                )
            except Exception as exc:  # noqa: BLE001 - classified below
                msg = describe_error(exc, self._secrets)
                status, retryable, fatal = classify_error(exc)
                calls.append(self._record(req, attempt, status, started, t0, error=msg))
                if fatal:
                    self._fatal = msg
                    log.error("fatal endpoint error, failing the rest of the run: %s", msg)
                if fatal or not retryable or attempt >= self.max_attempts:
                    error = f"{status} after {attempt} attempt(s): {msg}"
                    return QuestionResult(req.key, "failed", error=error, calls=calls)
                delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_max_s, self._rng)
                server = retry_after_seconds(exc)
                if server is not None:
                    delay = min(server, self.retry_after_max_s)
                self._sleep(delay)
                continue
            usage = getattr(completion, "usage", None)
            t_in = int(getattr(usage, "prompt_tokens", 0) or 0)
            t_out = int(getattr(usage, "completion_tokens", 0) or 0)
            try:
                items = parse_questions(_content_of(completion))
            except (MalformedQuestions, MalformedResponse) as exc:
                msg = scrub(f"malformed answer: {exc}", self._secrets)
                calls.append(self._record(req, attempt, "malformed", started, t0, t_in, t_out, msg))
                return QuestionResult(req.key, "malformed", error=msg, calls=calls)
            calls.append(self._record(req, attempt, "ok", started, t0, t_in, t_out))
            return QuestionResult(req.key, "ok", items=items, calls=calls)


# ------------------------------------------------------------------ the local, constrained one


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


def run_skeleton(
    model: Any,
    prompts: Sequence[Sequence[int]],
    machines: Sequence[SkeletonMachine],
    generators: Sequence[torch.Generator],
    *,
    temperature: float,
    top_k: int,
    repetition_penalty: float,
    close_boost: float = 0.0,
    pad_id: int,
) -> None:
    """Sample the answers of several prompts at once (left-padded batch ``(B, max P)``) under
    their machines; each row samples with its own generator (seeded per call)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    b = len(prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(list(p))
        mask[r, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    limit = max(m.max_new_tokens() for m in machines)
    with torch.no_grad():
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        last_pos = pos[:, -1]
        for _ in range(limit):
            logits = out.logits[:, -1].float().cpu()
            nxt = []
            for r, m in enumerate(machines):
                tok = m.forced()
                if tok is None:
                    row = logits[r]
                    if repetition_penalty != 1.0 and m.generated:
                        seen = torch.tensor(sorted(set(m.generated)))
                        vals = row[seen]
                        row = row.clone()
                        row[seen] = torch.where(
                            vals > 0, vals / repetition_penalty, vals * repetition_penalty
                        )
                    boost = m.close_boost(close_boost)
                    if boost:
                        row = row + m.sv.close.float() * boost
                    row = row.masked_fill(~m.allowed(), float("-inf")) / max(temperature, 1e-6)
                    top = torch.topk(row, min(top_k, int(torch.isfinite(row).sum())))
                    probs = torch.softmax(top.values, -1)
                    tok = int(top.indices[torch.multinomial(probs, 1, generator=generators[r])])
                m.advance(tok)
                nxt.append(tok)
            if all(m.done for m in machines):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
            last_pos = last_pos + 1
            out = model(
                input_ids=torch.tensor(nxt, device=device)[:, None],
                attention_mask=mask.to(device),
                position_ids=last_pos.to(device)[:, None],
                past_key_values=out.past_key_values,
                use_cache=True,
            )


class LocalQuestionGenerator:
    """Questions from a local causal LM under the JSON-array skeleton constraint (module doc).

    ``model``: a reference for ``inference.models.load_model`` (None: packaged SmolLM2) or a
    loaded ``LoadedModel``. Calls are run ``batch_size`` at a time; each samples with a
    generator seeded from its call key, so a call's questions do not depend on the batch.
    """

    backend = "local"

    def __init__(
        self,
        model: Any = None,
        *,
        n_questions: int = 20,
        min_question_tokens: int = 4,
        max_question_tokens: int = 24,
        temperature: float = 0.7,
        top_k: int = 50,
        repetition_penalty: float = 1.3,
        close_boost: float = 0.4,
        batch_size: int = 8,
        device: str = "cpu",
    ) -> None:
        self.model_ref = model
        self.n_questions = n_questions
        self.min_question_tokens = min_question_tokens
        self.max_question_tokens = max_question_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.repetition_penalty = repetition_penalty
        self.close_boost = close_boost
        self.batch_size = batch_size
        self.device = device
        self._loaded = None if model is None or isinstance(model, str) else model

    @property
    def loaded(self) -> Any:
        if self._loaded is None:
            from inference.models import load_model

            self._loaded = load_model(self.model_ref, device=self.device)
        return self._loaded

    @property
    def llm_model(self) -> str:
        return f"local@{self.loaded.model_fp}"

    @property
    def fingerprint(self) -> str:
        return generator_fingerprint(
            self.backend,
            {
                "model_fp": self.loaded.model_fp,
                "n": self.n_questions,
                "min_question_tokens": self.min_question_tokens,
                "max_question_tokens": self.max_question_tokens,
                "temperature": self.temperature,
                "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty,
                "close_boost": self.close_boost,
                "decoding": "json-skeleton-v2",
            },
        )

    def prompt_ids(self, req: QuestionRequest) -> list[int]:
        tok = self.loaded.tokenizer
        text = tok.apply_chat_template(
            build_local_messages(req.text, req.seed_type, self.n_questions),
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def generate(self, requests: Sequence[QuestionRequest]) -> list[QuestionResult]:
        """One result per request, in order (prompts of similar length batched together)."""
        tok = self.loaded.tokenizer
        sv = skeleton_vocab(tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else sv.eos
        results: dict[int, QuestionResult] = {}
        prompts = [self.prompt_ids(r) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            machines = [
                SkeletonMachine(
                    sv, self.n_questions, self.min_question_tokens, self.max_question_tokens
                )
                for _ in idx
            ]
            gens = [
                torch.Generator().manual_seed(int(requests[i].key[-12:], 16) % 2**62) for i in idx
            ]
            started, t0 = datetime.now(UTC), time.perf_counter()
            try:
                run_skeleton(
                    self.loaded.model,
                    [prompts[i] for i in idx],
                    machines,
                    gens,
                    temperature=self.temperature,
                    top_k=self.top_k,
                    repetition_penalty=self.repetition_penalty,
                    close_boost=self.close_boost,
                    pad_id=pad,
                )
                error = None
            except Exception as exc:  # noqa: BLE001 - recorded as failed calls
                error = f"{type(exc).__name__}: {exc}"
                log.warning("local question generation failed: %s", error)
            wall_ms = (time.perf_counter() - t0) * 1000.0 / len(idx)
            for i, m in zip(idx, machines, strict=True):
                req = requests[i]
                n_out = len(m.generated)
                if error is not None:
                    status, items = "failed", []
                else:
                    text = tok.decode([t for t in m.generated if t != sv.eos])
                    try:
                        status, items = "ok", parse_questions(text)
                    except MalformedQuestions as exc:  # never expected: the skeleton parses
                        status, items, error = "malformed", [], str(exc)
                rec = CallRecord(
                    call_id=new_call_id(),
                    key=req.key,
                    attempt=1,
                    status="ok"
                    if status == "ok"
                    else ("malformed" if status == "malformed" else "error"),
                    tokens_in=len(prompts[i]),
                    tokens_out=n_out,
                    cost_usd=0.0,
                    latency_ms=wall_ms,
                    started_at=started,
                    error=error,
                )
                results[i] = QuestionResult(req.key, status, items, error, [rec])
        return [results[i] for i in range(len(requests))]


# ---------------------------------------------------------------------------- the stage


@dataclass
class SelfStudyCounts:
    planned: int = 0
    cached: int = 0  # answered (ok or malformed) by an earlier run
    ok: int = 0
    malformed: int = 0  # dropped calls (not a JSON array of strings)
    failed: int = 0
    raw_items: int = 0
    questions: int = 0  # usable questions of this run's ok calls
    dropped_items: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    ledger_rows: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0


@dataclass(frozen=True)
class Question:
    """A usable question about one document."""

    question_id: str
    doc_id: str
    doc_version: str
    seed_type: str
    text: str


def question_id(key: str, ordinal: int) -> str:
    return "qq-" + sha256_hex("selfstudy-question", key, str(ordinal))[:24]


def selfstudy_stage(
    store: Store,
    docs: Sequence[DocumentRow],
    generator: Any,
    *,
    run_id: str,
    plan: Sequence[CallPlan] | None = None,
    seed: int = 0,
    n_calls: int | None = None,
    chars_per_call: int = 2000,
    batch: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Question], SelfStudyCounts]:
    """Make (or reuse) the questions of ``docs``; return every usable question of the plan.

    Calls already answered by this generator (``ok`` or ``malformed``) are not made again.
    Results are written ``batch`` calls at a time (a killed run loses at most one batch).
    """
    fp = generator.fingerprint
    if plan is None:
        plan = plan_calls(docs, seed=seed, n_calls=n_calls, chars_per_call=chars_per_call)
    counts = SelfStudyCounts(planned=len(plan))
    keys = [call_key(fp, p) for p in plan]
    done = {
        r.call_key: r
        for r in read_rows(
            store,
            SelfStudyCallRow,
            filter=(pc.field("generator_fp") == fp) & pc.field("status").isin(["ok", "malformed"]),
        )
    }
    todo: dict[str, CallPlan] = {}
    for key, p in zip(keys, plan, strict=True):
        if key in done:
            counts.cached += 1
        else:
            todo.setdefault(key, p)
    pending = list(todo.items())
    for start in range(0, len(pending), batch):
        part = pending[start : start + batch]
        reqs = [QuestionRequest(k, p.text, p.seed_type, p.call_index) for k, p in part]
        results = generator.generate(reqs)
        call_rows, q_rows, ledger = [], [], []
        for (key, p), res in zip(part, results, strict=True):
            kept, drops = usable_questions(res.items, p.text) if res.status == "ok" else ([], {})
            counts.ok += res.status == "ok"
            counts.malformed += res.status == "malformed"
            counts.failed += res.status == "failed"
            counts.raw_items += len(res.items)
            counts.questions += len(kept)
            counts.dropped_items += len(res.items) - len(kept)
            for reason, n in drops.items():
                counts.drop_reasons[reason] = counts.drop_reasons.get(reason, 0) + n
            call_rows.append(
                SelfStudyCallRow(
                    call_key=key,
                    generator_fp=fp,
                    backend=generator.backend,
                    doc_id=p.doc_id,
                    doc_version=p.doc_version,
                    text_hash=p.text_hash,
                    char_start=p.char_start,
                    char_end=p.char_end,
                    seed_type=p.seed_type,
                    call_index=p.call_index,
                    status=res.status,
                    n_raw=len(res.items),
                    n_questions=len(kept),
                    error=res.error,
                    run_id=run_id,
                    code_version=CODE_VERSION,
                )
            )
            q_rows += [
                SelfStudyQuestionRow(
                    question_id=question_id(key, i),
                    call_key=key,
                    doc_id=p.doc_id,
                    doc_version=p.doc_version,
                    seed_type=p.seed_type,
                    ordinal=i,
                    question=q,
                    generator_fp=fp,
                    run_id=run_id,
                    code_version=CODE_VERSION,
                )
                for i, q in enumerate(kept)
            ]
            for c in res.calls:
                counts.tokens_in += c.tokens_in
                counts.tokens_out += c.tokens_out
                counts.cost_usd += c.cost_usd
                ledger.append(
                    ledger_row(
                        c,
                        run_id=run_id,
                        backend=f"selfstudy-{generator.backend}",
                        llm_model=generator.llm_model,
                        text_hash=p.text_hash,
                        custom_id=key,
                    )
                )
        counts.ledger_rows += len(ledger)
        append_rows(store, call_rows, run_id, "selfstudy-calls")
        append_rows(store, q_rows, run_id, "selfstudy-questions")
        append_rows(store, ledger, run_id, "selfstudy-ledger")
        if progress is not None:
            progress(min(start + batch, len(pending)), len(pending))
    # every usable question of the plan (this run's and cached ones), attributed to the plan's doc
    by_key: dict[str, list[SelfStudyQuestionRow]] = {}
    for row in read_rows(store, SelfStudyQuestionRow, filter=pc.field("call_key").isin(keys)):
        by_key.setdefault(row.call_key, []).append(row)
    out: list[Question] = []
    seen: set[str] = set()
    for key, p in zip(keys, plan, strict=True):
        rows = {r.ordinal: r for r in by_key.get(key, [])}
        for ordinal in sorted(rows):
            qid = question_id(key, ordinal)
            if qid in seen:
                continue
            seen.add(qid)
            out.append(Question(qid, p.doc_id, p.doc_version, p.seed_type, rows[ordinal].question))
    return out, counts


# ---------------------------------------------------------------------------- the teacher


@dataclass(frozen=True)
class TeacherConfig:
    """Greedy answers of at most ``max_new_tokens`` tokens, ``top_k`` log-probs per position;
    documents longer than ``max_doc_tokens`` are cut (the cartridge stands for the same cut)."""

    max_new_tokens: int = 48
    top_k: int = 20
    batch_size: int = 8
    max_doc_tokens: int = 2048

    def value_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k,
            "max_doc_tokens": self.max_doc_tokens,
            "decoding": "greedy-v1",
        }


def teacher_fingerprint(model_fp: str, prefix_sha: str, cfg: TeacherConfig) -> str:
    """What a teacher answer depends on besides the document and the question."""
    return fingerprint(
        "teacher", {"model_fp": model_fp, "prefix_sha": prefix_sha, **cfg.value_dict()}
    )


def doc_token_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """The document's token ids as the context slot holds them (no special tokens), cut."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]


def context_hash(doc_ids: Sequence[int]) -> str:
    return "cx-" + sha256_hex("context", ",".join(str(int(t)) for t in doc_ids))[:24]


def answer_id(teacher_fp: str, ctx_hash: str, qid: str) -> str:
    return "ta-" + sha256_hex("teacher-answer", teacher_fp, ctx_hash, qid)[:24]


@dataclass(frozen=True, eq=False)
class TeacherOutput:
    answer_ids: list[int]
    topk_ids: torch.Tensor  # (n, k) int64
    topk_logprobs: torch.Tensor  # (n, k) float32


@torch.no_grad()
def teacher_answers(
    model: Any,
    tokenizer: Any,
    prompt: RagPrompt,
    doc_ids: Sequence[int],
    questions: Sequence[str],
    cfg: TeacherConfig,
) -> list[TeacherOutput]:
    """Greedy answers with top-k log-probs for questions about one document.

    The context ``prefix_ids + doc_ids`` (``T`` tokens) is encoded once; questions go in
    batches: query ids left-padded to ``(B, Q)`` *after* the context, padding masked out, real
    tokens at positions ``T..T+len-1``, so every row computes what a lone forward of
    ``prefix + doc + query`` computes.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ctx = list(prompt.prefix_ids) + list(doc_ids)
    t = len(ctx)
    out0 = model(input_ids=torch.tensor([ctx], device=device), use_cache=True)
    layers = [(lay.keys, lay.values) for lay in out0.past_key_values.layers]
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    results: list[TeacherOutput] = []
    for s in range(0, len(questions), cfg.batch_size):
        qs = [prompt.query_ids(q) for q in questions[s : s + cfg.batch_size]]
        b, width = len(qs), max(len(q) for q in qs)
        ids = torch.full((b, width), pad, dtype=torch.long)
        mask = torch.ones((b, t + width), dtype=torch.long)
        pos = torch.full((b, width), t, dtype=torch.long)
        for r, q in enumerate(qs):
            ids[r, width - len(q) :] = torch.tensor(q)
            mask[r, t : t + width - len(q)] = 0
            pos[r, width - len(q) :] = torch.arange(t, t + len(q))
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(layers):
            cache.update(
                k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous(), i
            )
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        last = pos[:, -1].clone()
        answers: list[list[int]] = [[] for _ in range(b)]
        tk_ids: list[list[torch.Tensor]] = [[] for _ in range(b)]
        tk_lp: list[list[torch.Tensor]] = [[] for _ in range(b)]
        done = [False] * b
        for step in range(cfg.max_new_tokens):
            logp = out.logits[:, -1].float().log_softmax(-1).cpu()
            top = torch.topk(logp, cfg.top_k, dim=-1)
            nxt = logp.argmax(-1)
            for r in range(b):
                if done[r]:
                    continue
                tok = int(nxt[r])
                answers[r].append(tok)
                tk_ids[r].append(top.indices[r])
                tk_lp[r].append(top.values[r])
                done[r] = tok in eos
            if all(done) or step == cfg.max_new_tokens - 1:
                break
            feed = torch.tensor([min(eos) if done[r] else int(nxt[r]) for r in range(b)])
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
            last = last + 1
            out = model(
                input_ids=feed[:, None].to(device),
                attention_mask=mask.to(device),
                position_ids=last[:, None].to(device),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        for r in range(b):
            results.append(
                TeacherOutput(
                    answers[r],
                    torch.stack(tk_ids[r]).to(torch.int64),
                    torch.stack(tk_lp[r]).to(torch.float32),
                )
            )
    return results


@dataclass
class TeacherCounts:
    questions: int = 0
    cached: int = 0
    answered: int = 0
    answer_tokens: int = 0
    ended_eos: int = 0
    seconds: float = 0.0


def teacher_stage(
    store: Store,
    model: Any,
    tokenizer: Any,
    prompt: RagPrompt,
    model_fp: str,
    docs: dict[str, DocumentRow],
    questions: Sequence[Question],
    cfg: TeacherConfig,
    *,
    run_id: str,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[TeacherAnswerRow], TeacherCounts]:
    """Answer (or reuse the answers to) ``questions``; return one row per question.

    ``docs``: doc_id -> the document version the questions are about (its text is the context).
    Answers are written per document (a killed run loses at most one document's answers).
    """
    tfp = teacher_fingerprint(model_fp, prompt.prefix_sha, cfg)
    counts = TeacherCounts(questions=len(questions))
    t0 = time.perf_counter()
    have = {
        r.answer_id: r
        for r in read_rows(store, TeacherAnswerRow, filter=pc.field("teacher_fp") == tfp)
    }
    by_doc: dict[str, list[Question]] = {}
    for q in questions:
        by_doc.setdefault(q.doc_id, []).append(q)
    rows: dict[str, TeacherAnswerRow] = {}
    done_docs = 0
    for doc_id in sorted(by_doc):
        doc = docs[doc_id]
        ids = doc_token_ids(tokenizer, doc.text, cfg.max_doc_tokens)
        cx = context_hash(ids)
        todo = []
        for q in by_doc[doc_id]:
            aid = answer_id(tfp, cx, q.question_id)
            if aid in have:
                rows[q.question_id] = have[aid]
                counts.cached += 1
            else:
                todo.append((aid, q))
        if todo:
            outs = teacher_answers(model, tokenizer, prompt, ids, [q.text for _, q in todo], cfg)
            new = []
            eos = _eos_ids(model, tokenizer)
            for (aid, q), o in zip(todo, outs, strict=True):
                row = TeacherAnswerRow(
                    answer_id=aid,
                    question_id=q.question_id,
                    doc_id=doc.doc_id,
                    doc_version=doc.doc_version,
                    context_hash=cx,
                    teacher_fp=tfp,
                    model_fp=model_fp,
                    answer_ids=list(o.answer_ids),
                    answer_text=tokenizer.decode(o.answer_ids, skip_special_tokens=True).strip(),
                    top_k=cfg.top_k,
                    topk_ids=o.topk_ids.reshape(-1).tolist(),
                    topk_logprobs=o.topk_logprobs.reshape(-1).tolist(),
                    run_id=run_id,
                    code_version=CODE_VERSION,
                )
                new.append(row)
                rows[q.question_id] = row
                counts.answered += 1
                counts.answer_tokens += len(o.answer_ids)
                counts.ended_eos += bool(o.answer_ids) and o.answer_ids[-1] in eos
            append_rows(store, new, run_id, "teacher")
        done_docs += 1
        if progress is not None:
            progress(done_docs, len(by_doc))
    counts.seconds = time.perf_counter() - t0
    return [rows[q.question_id] for q in questions], counts


def topk_tensors(row: TeacherAnswerRow) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids (n, k) int64, topk_logprobs (n, k) float32)`` of a stored answer."""
    n, k = len(row.answer_ids), row.top_k
    ids = torch.tensor(row.topk_ids, dtype=torch.int64).reshape(n, k)
    lp = torch.tensor(row.topk_logprobs, dtype=torch.float32).reshape(n, k)
    return ids, lp
