"""Extraction stage: ask the extractor for candidates of every chunk text not yet answered.

The response cache is the ``extractions`` table keyed by ``(text_hash, extractor_fp)``: a text
answered ``ok`` by this extractor (same LLM, prompt version, decoding settings) is never sent
again, in this build or any later one. Every call is ledgered in ``extraction_calls``.

Two kinds of failure, settled differently:

- ``failed`` (transient: transport errors, timeouts, 429, 5xx): the next build asks again, as
  many times as it takes;
- ``malformed`` (content: every reply of the build, repair requests included, was unreadable):
  the next build asks again, until the text was ``malformed`` in ``abandon_after`` builds under
  the same extractor fingerprint; then :func:`abandon_repeated` records it ``abandoned`` (an
  ``extractions`` row with the run and fingerprint that settled it: the
  ``abandoned_extractions`` lineage view lists them). An abandoned text has no LLM nuggets and
  is not asked again (:func:`settled_answers`) until the fingerprint changes or a build runs
  with ``retry_abandoned``.

Each answer of an extractor with ``stage_answers`` (LLM endpoints, local models) is on disk as
soon as it arrives (``stage_result``, a staged file per answer, written wherever the task runs);
the flow process, the store's one writer, counts them while it waits (progress) and moves them
into the tables (:class:`ExtractionWriter`) when a task returns, and at the start of the next
build for what a killed one left. So a build killed after N answers resumes asking only for the
rest, and no other cache (Prefect's) stands between a failed answer and its retry.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow.compute as pc

from coinrag.inference.llm.client import CallRecord
from coinrag.schemas.keys import CODE_VERSION
from coinrag.schemas.tables import (
    CALL_SALVAGED,
    EXTRACTION_ABANDONED,
    EXTRACTION_MALFORMED,
    EXTRACTION_OK,
    ChunkRow,
    ExtractionCallRow,
    ExtractionRow,
)
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_files, read_rows, stage_rows, staged_files
from coinrag.tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    Extractor,
    ResultFn,
)


def _commonest(errors: dict[str, int]) -> str:
    reason = max(errors, key=lambda e: errors[e]) if errors else "unknown"
    return reason if len(reason) <= 160 else reason[:157] + "..."


@dataclass
class ExtractCounts:
    """Chunk texts (distinct ``text_hash``) per outcome of one build's extraction stage."""

    requested: int = 0  # distinct chunk texts needing an answer
    cached: int = 0  # answered ok by an earlier run
    ok: int = 0
    failed: int = 0  # transient failures: the next build asks again
    malformed: int = 0  # content failures of this build (abandoned ones included)
    abandoned: int = 0  # malformed texts this build settled as abandoned
    abandoned_before: int = 0  # not asked: abandoned by an earlier build (same fingerprint)
    salvaged: int = 0  # answered by the readable items of a malformed reply
    calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # failure reason -> failed answers
    malformed_errors: dict[str, int] = field(default_factory=dict)  # reason -> malformed

    def failure_line(self) -> str | None:
        """One line on what failed transiently (the commonest reason), or None."""
        if not self.failed:
            return None
        reason = _commonest(self.errors)
        return f"{self.failed} of {self.requested} chunk texts could not be extracted ({reason})"

    def malformed_line(self, abandon_after: int) -> str | None:
        """One line on the malformed texts the next build asks again, or None."""
        left = self.malformed - self.abandoned
        if left <= 0:
            return None
        reason = _commonest(self.malformed_errors)
        return (
            f"{left} of {self.requested} chunk texts got only malformed replies ({reason}); "
            f"a text malformed in {abandon_after} builds is abandoned"
        )

    def abandoned_line(self, abandon_after: int) -> str | None:
        """The one warning of a build that abandoned texts, or None."""
        if not self.abandoned:
            return None
        return (
            f"{self.abandoned} chunk text(s) abandoned: their replies were malformed in "
            f"{abandon_after} builds of this extractor; they keep no LLM nuggets "
            "(coinrag build --retry-abandoned asks again; the lineage view "
            "abandoned_extractions lists them)"
        )


def answered_ok(store: Store, extractor_fp: str) -> dict[str, ExtractionRow]:
    """Latest ``ok`` extraction per text_hash for this extractor."""
    rows = read_rows(
        store,
        ExtractionRow,
        filter=(pc.field("extractor_fp") == extractor_fp) & (pc.field("status") == EXTRACTION_OK),
    )
    return {r.text_hash: r for r in rows}


def settled_answers(
    store: Store, extractor_fp: str, retry_abandoned: bool = False
) -> dict[str, ExtractionRow]:
    """The texts this extractor is not asked about again: its latest ``ok`` answer per
    text_hash, and (unless ``retry_abandoned``) its ``abandoned`` rows."""
    statuses = [EXTRACTION_OK] if retry_abandoned else [EXTRACTION_OK, EXTRACTION_ABANDONED]
    rows = read_rows(
        store,
        ExtractionRow,
        filter=(pc.field("extractor_fp") == extractor_fp) & pc.field("status").isin(statuses),
    )
    out: dict[str, ExtractionRow] = {}
    for r in rows:
        if r.status == EXTRACTION_OK or r.text_hash not in out:
            out[r.text_hash] = r
    return out


def abandon_repeated(
    store: Store,
    extractor_fp: str,
    run_id: str,
    abandon_after: int,
    counts: ExtractCounts | None = None,
) -> list[ExtractionRow]:
    """Record ``abandoned`` every text this run got only malformed replies for that was
    malformed in ``abandon_after`` builds (distinct runs, this one included) under
    ``extractor_fp``; return the rows written (and count them in ``counts``).

    The row copies the run's malformed row (backend, model, prompt version), with this run's
    id and the error ``malformed in N builds: <last reason>``."""
    malformed = read_rows(
        store,
        ExtractionRow,
        filter=(pc.field("extractor_fp") == extractor_fp)
        & (pc.field("status") == EXTRACTION_MALFORMED),
    )
    mine = {r.text_hash: r for r in malformed if r.run_id == run_id}
    runs: dict[str, set[str]] = {}
    for r in malformed:
        if r.text_hash in mine:
            runs.setdefault(r.text_hash, set()).add(r.run_id)
    rows = [
        replace(
            mine[key],
            status=EXTRACTION_ABANDONED,
            error=f"malformed in {len(ids)} builds: {mine[key].error or 'no reason given'}",
            candidates=[],
            code_version=CODE_VERSION,
        )
        for key, ids in sorted(runs.items())
        if len(ids) >= abandon_after
    ]
    append_rows(store, rows, run_id, "extract-abandon")
    if counts is not None:
        counts.abandoned += len(rows)
    return rows


def pending_requests(
    chunks: Sequence[ChunkRow], done: dict[str, ExtractionRow]
) -> list[ExtractionRequest]:
    """One request per distinct chunk text without an ok answer, in chunk order."""
    seen: set[str] = set()
    out = []
    for c in chunks:
        if c.text_hash in done or c.text_hash in seen:
            continue
        seen.add(c.text_hash)
        out.append(ExtractionRequest(key=c.text_hash, text=c.text))
    return out


def ledger_row(
    call: CallRecord,
    *,
    run_id: str,
    backend: str,
    llm_model: str,
    text_hash: str | None = None,
    custom_id: str | None = None,
) -> ExtractionCallRow:
    """The ledger row of one call (``text_hash``/``custom_id`` default to the call's own)."""
    return ExtractionCallRow(
        call_id=call.call_id or uuid.uuid4().hex,
        run_id=run_id,
        backend=backend,
        llm_model=llm_model,
        text_hash=text_hash if text_hash is not None else call.key,
        custom_id=custom_id if custom_id is not None else call.custom_id,
        batch_id=call.batch_id,
        attempt=call.attempt,
        status=call.status,
        tokens_in=call.tokens_in,
        tokens_out=call.tokens_out,
        cost_usd=call.cost_usd,
        latency_ms=call.latency_ms,
        error=call.error,
        started_at=call.started_at,
    )


def result_rows(
    results: Sequence[ExtractionResult], extractor: Extractor, run_id: str
) -> tuple[list[ExtractionRow], list[ExtractionCallRow]]:
    """Table rows for a batch of results: the answers and the ledger."""
    fp = extractor.fingerprint
    prompt_version = getattr(extractor, "prompt_version", "")
    answers = [
        ExtractionRow(
            text_hash=r.key,
            extractor_fp=fp,
            backend=extractor.backend,
            llm_model=extractor.llm_model,
            prompt_version=prompt_version,
            candidates=list(r.candidates) if r.status == EXTRACTION_OK else [],
            status=r.status,
            error=r.error,
            run_id=run_id,
            code_version=CODE_VERSION,
        )
        for r in results
    ]
    calls = [
        ledger_row(c, run_id=run_id, backend=extractor.backend, llm_model=extractor.llm_model)
        for r in results
        for c in r.calls
    ]
    return answers, calls


@dataclass
class ExtractBatch:
    """One batch's answers and ledger rows: computed (on a worker, maybe), not yet written."""

    answers: list[ExtractionRow]
    calls: list[ExtractionCallRow]


def run_extraction(
    extractor: Extractor,
    requests: Sequence[ExtractionRequest],
    run_id: str,
    on_result: ResultFn | None = None,
) -> ExtractBatch:
    """Ask the extractor about one batch of requests; write nothing (``on_result`` may)."""
    results = extractor.extract(requests, on_result)
    return ExtractBatch(*result_rows(results, extractor, run_id))


def stage_result(store: Store, extractor: Extractor, run_id: str, result: ExtractionResult) -> None:
    """Put one finished result on disk at once, wherever it was computed: its ledger rows, then
    its answer, as staged files (``storage.tables.stage_rows``) that :class:`ExtractionWriter`
    moves into the tables. A build killed after this loses nothing it paid for."""
    answers, calls = result_rows([result], extractor, run_id)
    stage_rows(store, calls, run_id, "extract-calls")
    stage_rows(store, answers, run_id, "extract")


def _answer_key(row: ExtractionRow) -> tuple[str, str, str]:
    return (row.text_hash, row.extractor_fp, row.run_id)


def _call_key(row: ExtractionCallRow) -> str:
    return row.call_id


class ExtractionWriter:
    """The store writer's side of the stage: moves answers and ledger rows into the tables,
    each exactly once, and counts this run's.

    Rows arrive twice: staged, one file per result as it finished (``stage_result``, run by the
    task wherever it runs; also what a killed build left), and in the batches the tasks return
    (the fallback if staging failed). :meth:`flush` appends what is new (an answer is
    ``(text_hash, extractor_fp, run_id)``, a ledger row its ``call_id``; rows of another run are
    checked against the tables, since a build killed between appending and removing its staged
    files leaves both) as one file per table, then removes the staged files it read.
    """

    def __init__(self, store: Store, run_id: str, counts: ExtractCounts) -> None:
        self.store, self.run_id, self.counts = store, run_id, counts
        self._written: dict[type, set[Any]] = {ExtractionRow: set(), ExtractionCallRow: set()}
        self._own_answers = 0

    def answered(self) -> int:
        """This run's answers so far (ok or failed): written, or staged and not yet moved."""
        return self._own_answers + len(staged_files(self.store, ExtractionRow, self.run_id))

    def flush(self, batch: ExtractBatch | None = None) -> int:
        """Move the staged rows of every run and ``batch``'s rows into the tables; return how
        many answers were written."""
        call_files = staged_files(self.store, ExtractionCallRow)
        answer_files = staged_files(self.store, ExtractionRow)
        calls = read_files(self.store, ExtractionCallRow, call_files)
        answers = read_files(self.store, ExtractionRow, answer_files)
        if batch is not None:
            calls += batch.calls
            answers += batch.answers
        calls = self._unwritten(ExtractionCallRow, calls, _call_key)
        answers = self._unwritten(ExtractionRow, answers, _answer_key)
        append_rows(self.store, calls, self.run_id, "extract-calls")
        append_rows(self.store, answers, self.run_id, "extract")
        for path in call_files + answer_files:
            self.store.remove(path)
        self._count(
            [a for a in answers if a.run_id == self.run_id],
            [c for c in calls if c.run_id == self.run_id],
        )
        return len(answers)

    def _unwritten(self, record: type, rows: list[Any], key: Callable[[Any], Any]) -> list[Any]:
        written = self._written[record]
        others = sorted({r.run_id for r in rows} - {self.run_id})
        if others:
            in_tables = read_rows(self.store, record, filter=pc.field("run_id").isin(others))
            written |= {key(r) for r in in_tables}
        fresh = []
        for row in rows:
            if key(row) not in written:
                written.add(key(row))
                fresh.append(row)
        return fresh

    def _count(self, answers: list[ExtractionRow], calls: list[ExtractionCallRow]) -> None:
        counts = self.counts
        self._own_answers += len(answers)
        for a in answers:
            if a.status == EXTRACTION_OK:
                counts.ok += 1
                continue
            malformed = a.status == EXTRACTION_MALFORMED
            counts.malformed += malformed
            counts.failed += not malformed
            errors = counts.malformed_errors if malformed else counts.errors
            reason = a.error or "no reason given"
            errors[reason] = errors.get(reason, 0) + 1
        counts.salvaged += sum(c.status == CALL_SALVAGED for c in calls)
        counts.calls += len(calls)
        counts.tokens_in += sum(c.tokens_in for c in calls)
        counts.tokens_out += sum(c.tokens_out for c in calls)
        counts.cost_usd += sum(c.cost_usd for c in calls)
