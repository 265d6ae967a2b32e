"""The self-study stage of the cartridges (CAS appendix I; Cartridges, Eyuboglu et al. 2025):
synthetic questions about each document, planned, cached per call, and filtered.

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

Generators (``tasks/question_generators/``): ``openai`` (chat completions on any
OpenAI-compatible endpoint; every HTTP attempt is a ledger row, backend ``selfstudy-openai``) and
``local`` (a local causal LM sampled under a JSON-array skeleton), built from the settings by
``question_generators.factory.make_generator``; the prompt and its seed types are
``question_generators/prompt.py``.

The teacher's answers to these questions are ``tasks/teacher.py``; what counts as a usable
question is ``tasks/question_generators/accept.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, TypeVar

import pyarrow.compute as pc

from coinrag.schemas.keys import CODE_VERSION, sha256_hex, text_hash
from coinrag.schemas.settings import CartridgeSettings
from coinrag.schemas.tables import (
    DocumentRow,
    ExtractionCallRow,
    SelfStudyCallRow,
    SelfStudyQuestionRow,
)
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_rows
from coinrag.tasks.extract import ledger_row
from coinrag.tasks.question_generators.accept import usable_questions
from coinrag.tasks.question_generators.base import (
    QuestionGenerator,
    QuestionRequest,
    QuestionResult,
)
from coinrag.tasks.question_generators.prompt import SEED_TYPES

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
        if s not in SEED_TYPES:
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
    call_key: str  # the cache key of the call that wrote it (:func:`call_key`)


_DEFAULT_SETTINGS = CartridgeSettings()


def question_id(key: str, ordinal: int) -> str:
    return "qq-" + sha256_hex("selfstudy-question", key, str(ordinal))[:24]


def selfstudy_stage(
    store: Store,
    docs: Sequence[DocumentRow],
    generator: QuestionGenerator,
    *,
    run_id: str,
    plan: Sequence[CallPlan] | None = None,
    settings: CartridgeSettings = _DEFAULT_SETTINGS,
    batch: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Question], SelfStudyCounts]:
    """Make (or reuse) the questions of ``docs``; return every usable question of the plan.

    ``plan`` defaults to :func:`plan_calls` of ``docs`` with the ``seed``, ``n_calls`` and
    ``chars_per_call`` of ``settings``. Calls already answered by this generator (``ok`` or
    ``malformed``) are not made again. Results are written ``batch`` calls at a time (a killed
    run loses at most one batch). ``progress(questions written, questions to write)`` as the
    generator writes them (each OpenAI call counts its ``n_questions`` when it returns; the
    local generator each question).
    """
    if plan is None:
        plan = plan_calls(
            docs,
            seed=settings.seed,
            n_calls=settings.n_calls,
            chars_per_call=settings.chars_per_call,
        )
    counts = SelfStudyCounts(planned=len(plan))
    fp = generator.fingerprint
    keys = [call_key(fp, p) for p in plan]
    pending = _pending_calls(store, fp, keys, plan, counts)
    writer = _CallWriter(store, generator, run_id, counts)
    on_questions = ProgressCounter(progress, len(pending) * generator.n_questions)
    for start in range(0, len(pending), batch):
        part = pending[start : start + batch]
        reqs = [QuestionRequest(k, p.text, p.seed_type, p.call_index) for k, p in part]
        writer.write(part, generator.generate(reqs, on_questions))
    return _plan_questions(store, keys, plan), counts


class ProgressCounter:
    """``progress(done, total)`` as work of ``n`` units at a time is reported done."""

    def __init__(self, progress: Callable[[int, int], None] | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _pending_calls(
    store: Store, fp: str, keys: list[str], plan: Sequence[CallPlan], counts: SelfStudyCounts
) -> list[tuple[str, CallPlan]]:
    """The plan's calls not yet answered (``ok`` or ``malformed``) by generator ``fp``, one per
    key, in plan order; the answered ones are counted as cached."""
    answered = {
        r.call_key
        for r in read_rows(
            store,
            SelfStudyCallRow,
            filter=(pc.field("generator_fp") == fp) & pc.field("status").isin(["ok", "malformed"]),
        )
    }
    todo: dict[str, CallPlan] = {}
    for key, p in zip(keys, plan, strict=True):
        if key in answered:
            counts.cached += 1
        else:
            todo.setdefault(key, p)
    return list(todo.items())


_CallRow = TypeVar("_CallRow", SelfStudyCallRow, SelfStudyQuestionRow)


def _add(into: dict[str, int], reason: str, n: int = 1) -> None:
    into[reason] = into.get(reason, 0) + n


@dataclass
class _CallWriter:
    """Counts and writes the results of a batch of generator calls: one ``SelfStudyCallRow``
    per call, its usable questions and its ledger rows."""

    store: Store
    generator: QuestionGenerator
    run_id: str
    counts: SelfStudyCounts

    @cached_property
    def fp(self) -> str:
        """The generator's fingerprint (computed once)."""
        return self.generator.fingerprint

    def write(self, part: list[tuple[str, CallPlan]], results: Sequence[QuestionResult]) -> None:
        call_rows: list[SelfStudyCallRow] = []
        q_rows: list[SelfStudyQuestionRow] = []
        ledger: list[ExtractionCallRow] = []
        for (key, p), res in zip(part, results, strict=True):
            kept = self._count(res, p.text)
            call_rows.append(self._call_row(key, p, res, len(kept)))
            q_rows += self._question_rows(key, p, kept)
            ledger += self._ledger_rows(key, p, res)
        self.counts.ledger_rows += len(ledger)
        append_rows(self.store, call_rows, self.run_id, "selfstudy-calls")
        append_rows(self.store, q_rows, self.run_id, "selfstudy-questions")
        append_rows(self.store, ledger, self.run_id, "selfstudy-ledger")

    def _count(self, res: QuestionResult, text: str) -> list[str]:
        """Count one call's result; return its usable questions."""
        counts = self.counts
        kept, drops = usable_questions(res.items, text) if res.status == "ok" else ([], {})
        counts.ok += res.status == "ok"
        counts.malformed += res.status == "malformed"
        if res.status == "malformed":
            _add(counts.malformed_reasons, res.malformed_reason or "malformed")
        counts.failed += res.status == "failed"
        counts.raw_items += len(res.items)
        counts.questions += len(kept)
        counts.dropped_items += len(res.items) - len(kept)
        for reason, n in drops.items():
            _add(counts.drop_reasons, reason, n)
        return kept

    def _row(self, cls: type[_CallRow], key: str, p: CallPlan, **values: Any) -> _CallRow:
        """A ``cls`` row of the call ``key`` of plan ``p``: the call's key, this generator and
        run, every column of ``cls`` the plan has (``doc_id``, ``seed_type``, ...), then
        ``values``."""
        plan = {f.name: getattr(p, f.name) for f in fields(cls) if hasattr(p, f.name)}
        return cls(
            call_key=key,
            generator_fp=self.fp,
            run_id=self.run_id,
            code_version=CODE_VERSION,
            **plan,
            **values,
        )

    def _call_row(
        self, key: str, p: CallPlan, res: QuestionResult, n_questions: int
    ) -> SelfStudyCallRow:
        return self._row(
            SelfStudyCallRow,
            key,
            p,
            backend=self.generator.backend,
            status=res.status,
            n_raw=len(res.items),
            n_questions=n_questions,
            error=res.error,
        )

    def _question_rows(self, key: str, p: CallPlan, kept: list[str]) -> list[SelfStudyQuestionRow]:
        return [
            self._row(
                SelfStudyQuestionRow, key, p, question_id=question_id(key, i), ordinal=i, question=q
            )
            for i, q in enumerate(kept)
        ]

    def _ledger_rows(self, key: str, p: CallPlan, res: QuestionResult) -> list[ExtractionCallRow]:
        """One ledger row per HTTP attempt of the call; its tokens and cost are counted."""
        rows = []
        for c in res.calls:
            self.counts.tokens_in += c.tokens_in
            self.counts.tokens_out += c.tokens_out
            self.counts.cost_usd += c.cost_usd
            rows.append(
                ledger_row(
                    c,
                    run_id=self.run_id,
                    backend=f"selfstudy-{self.generator.backend}",
                    llm_model=self.generator.llm_model,
                    text_hash=p.text_hash,
                    custom_id=key,
                )
            )
        return rows


def _plan_questions(store: Store, keys: list[str], plan: Sequence[CallPlan]) -> list[Question]:
    """Every usable question of the plan (this run's and cached ones), attributed to the plan's
    doc, in plan then ordinal order, each once."""
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
            out.append(
                Question(qid, p.doc_id, p.doc_version, p.seed_type, rows[ordinal].question, key)
            )
    return out
