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
so a rerun makes no call. An answer that is not a JSON array is dropped and counted with its
reason (``status="malformed"``, cached, not retried; a JSON object is malformed even when it
holds a list); items that are not usable questions (not a string, a statement rather than a
question or request, too few or too many words, duplicates, no content word of the document)
are dropped and counted per call (``n_raw - n_questions``) and per reason
(:class:`SelfStudyCounts`; the rules are ``tasks/question_generators/accept.py``).

Backends:

- ``openai`` (:class:`OpenAIQuestionGenerator`): chat completions on api.openai.com or any
  compatible endpoint, through ``inference/llm_client.py`` as the extractors use it (client
  without its own retries, retries with backoff and ``Retry-After``, fatal errors stop the run,
  secrets scrubbed); every HTTP attempt is a ledger row (``extraction_calls``, backend
  ``selfstudy-openai``).
- ``local`` (:class:`LocalQuestionGenerator`): the packaged SmolLM2-135M-Instruct is too weak to
  write free JSON, so the structure is forced: the answer is decoded under a constraint that
  emits ``["`` first, then lets the model write question text (sampling; the first token is
  the start of a question word such as ``What`` / ``How`` / ``Can``, then no ``"``, ``\\``,
  control characters or ``?`` inside), ends a question at a token ending with ``?`` (allowed
  after ``min_question_tokens`` with a logit bonus growing with the length, forced at
  ``max_question_tokens``), emits ``", "`` between questions and ``"]`` after the ``n``-th. The
  output always parses; usability is measured by the same filter as the OpenAI path.

The teacher's answers to these questions are ``tasks/teacher.py``; what counts as a usable
question is ``tasks/question_generators/accept.py``.
"""

from __future__ import annotations

import json
import logging
import random
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

from inference.constrained import SampledChoice, decode_constrained
from inference.llm_client import (
    CallRecord,
    LlmEndpoint,
    MalformedResponse,
    RetryPolicy,
    classify_error,
    content_of,
    new_call_id,
)
from schemas.keys import CODE_VERSION, fingerprint, sha256_hex, text_hash
from schemas.tables import (
    DocumentRow,
    SelfStudyCallRow,
    SelfStudyQuestionRow,
)
from storage.store import Store
from storage.tables import append_rows, read_rows
from tasks.extract import ledger_row
from tasks.question_generators.accept import (
    ACCEPTS_VERSION,
    MalformedQuestions,
    parse_questions,
    usable_questions,
)

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
    malformed_reason: str | None = None  # why a malformed answer was dropped (questions.py)


# Progress of a generator: called with the number of questions just written (an OpenAI call
# counts its n_questions when it returns, the local generator each question as it closes).
QuestionsDone = Callable[[int], None]


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
        retry = RetryPolicy(max_attempts, backoff_base_s, backoff_max_s, retry_after_max_s, sleep)
        self.endpoint = LlmEndpoint(
            model,
            client=client,
            base_url=base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            retry=retry,
        )
        self._fatal: str | None = None
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        return generator_fingerprint(
            self.backend,
            {
                "model": self.llm_model,
                "n": self.n_questions,
                "temperature": self.temperature,
                # what is accepted from a free answer (the local skeleton's output is always an
                # array of questions, so its fingerprint does not carry this)
                "accepts": ACCEPTS_VERSION,
            },
        )

    def generate(
        self, requests: Sequence[QuestionRequest], progress: QuestionsDone | None = None
    ) -> list[QuestionResult]:
        """One result per request, in order; never raises for one bad call.
        ``progress(n_questions)`` after each call (from the worker threads, one at a time)."""
        self._fatal = None

        def run(req: QuestionRequest) -> QuestionResult:
            try:
                result = self._one(req)
            except Exception as exc:  # noqa: BLE001 - one call must not sink the run
                result = QuestionResult(req.key, "failed", error=self.endpoint.describe(exc))
            if progress is not None:
                with self._lock:
                    progress(self.n_questions)
            return result

        if not requests:
            return []
        workers = min(self.concurrency, len(requests))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="selfstudy") as pool:
            return list(pool.map(run, requests))

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
                completion = self.endpoint.client.chat.completions.create(
                    model=self.llm_model, messages=messages, temperature=self.temperature
                )
            except Exception as exc:  # noqa: BLE001 - classified below
                msg = self.endpoint.describe(exc)
                status, retryable, fatal = classify_error(exc)
                calls.append(self.endpoint.record(req.key, attempt, status, started, t0, error=msg))
                if fatal:
                    self._fatal = msg
                    log.error("fatal endpoint error, failing the rest of the run: %s", msg)
                if fatal or not retryable or attempt >= self.endpoint.retry.max_attempts:
                    error = f"{status} after {attempt} attempt(s): {msg}"
                    return QuestionResult(req.key, "failed", error=error, calls=calls)
                self.endpoint.retry.sleep(self.endpoint.retry.delay(attempt, exc))
                continue
            usage = getattr(completion, "usage", None)
            t_in = int(getattr(usage, "prompt_tokens", 0) or 0)
            t_out = int(getattr(usage, "completion_tokens", 0) or 0)
            try:
                items = parse_questions(content_of(completion))
            except (MalformedQuestions, MalformedResponse) as exc:
                msg = self.endpoint.scrub(f"malformed answer: {exc}")
                calls.append(
                    self.endpoint.record(
                        req.key, attempt, "malformed", started, t0, t_in, t_out, msg
                    )
                )
                reason = getattr(exc, "reason", "no_content")
                return QuestionResult(
                    req.key, "malformed", error=msg, calls=calls, malformed_reason=reason
                )
            calls.append(self.endpoint.record(req.key, attempt, "ok", started, t0, t_in, t_out))
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


def _question_progress(
    machines: Sequence[SkeletonMachine], progress: QuestionsDone | None
) -> Callable[[int], None] | None:
    """``on_advance`` for the decoder: ``progress(1)`` each time a row closes a question."""
    if progress is None:
        return None
    closed = [0] * len(machines)

    def advanced(row: int) -> None:
        if machines[row].questions > closed[row]:
            closed[row] = machines[row].questions
            progress(1)

    return advanced


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

    def generate(
        self, requests: Sequence[QuestionRequest], progress: QuestionsDone | None = None
    ) -> list[QuestionResult]:
        """One result per request, in order (prompts of similar length batched together);
        ``progress(1)`` each time a question is written, then the rest of a call's questions
        when it fails or ends early."""
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
            choice = SampledChoice(
                self.temperature, self.top_k, gens, self.repetition_penalty, self.close_boost
            )
            started, t0 = datetime.now(UTC), time.perf_counter()
            try:
                # one token per step, every row to the end: how the cached questions were
                # sampled (the generator's fingerprint says "json-skeleton-v2")
                decode_constrained(
                    self.loaded.model,
                    [prompts[i] for i in idx],
                    machines,
                    choice,
                    pad,
                    jump_forward=False,
                    on_advance=_question_progress(machines, progress),
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
                    status, items, reason = "failed", [], None
                else:
                    text = tok.decode([t for t in m.generated if t != sv.eos])
                    try:
                        status, items, reason = "ok", parse_questions(text), None
                    except MalformedQuestions as exc:  # never expected: the skeleton parses
                        status, items, error, reason = "malformed", [], str(exc), exc.reason
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
                results[i] = QuestionResult(req.key, status, items, error, [rec], reason)
            if progress is not None:  # questions a failed batch never wrote
                rest = sum(max(self.n_questions - m.questions, 0) for m in machines)
                if rest:
                    progress(rest)
        return [results[i] for i in range(len(requests))]


# ---------------------------------------------------------------------------- the stage


@dataclass
class SelfStudyCounts:
    planned: int = 0
    cached: int = 0  # answered (ok or malformed) by an earlier run
    ok: int = 0
    malformed: int = 0  # dropped calls (not a JSON array: question_generators/accept.py)
    malformed_reasons: dict[str, int] = field(default_factory=dict)
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
    ``progress(questions written, questions to write)`` as the generator writes them (each
    OpenAI call counts its ``n_questions`` when it returns; the local generator each question).
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
    written, to_write = 0, len(pending) * generator.n_questions

    def questions_done(n: int) -> None:
        nonlocal written
        written += n
        if progress is not None:
            progress(written, to_write)

    for start in range(0, len(pending), batch):
        part = pending[start : start + batch]
        reqs = [QuestionRequest(k, p.text, p.seed_type, p.call_index) for k, p in part]
        results = generator.generate(reqs, questions_done)
        call_rows, q_rows, ledger = [], [], []
        for (key, p), res in zip(part, results, strict=True):
            kept, drops = usable_questions(res.items, p.text) if res.status == "ok" else ([], {})
            counts.ok += res.status == "ok"
            counts.malformed += res.status == "malformed"
            if res.status == "malformed":
                why = res.malformed_reason or "malformed"
                counts.malformed_reasons[why] = counts.malformed_reasons.get(why, 0) + 1
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
