"""Extraction stage: ask the extractor for candidates of every chunk text not yet answered.

The response cache is the ``extractions`` table keyed by ``(text_hash, extractor_fp)``: a text
answered ``ok`` by this extractor (same LLM, prompt version, decoding settings) is never sent
again, in this build or any later one. Failed answers are recorded as ``failed`` (with the error)
and retried by the next build. Every call is ledgered in ``extraction_calls``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow.compute as pc

from schemas.keys import CODE_VERSION
from schemas.tables import ChunkRow, ExtractionCallRow, ExtractionRow
from storage.store import Store
from storage.tables import append_rows, read_rows
from tasks.extractors.base import CallRecord, ExtractionRequest, ExtractionResult, Extractor


@dataclass
class ExtractCounts:
    requested: int = 0  # distinct chunk texts needing an answer
    cached: int = 0  # answered ok by an earlier run
    ok: int = 0
    failed: int = 0
    calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0


def answered_ok(store: Store, extractor_fp: str) -> dict[str, ExtractionRow]:
    """Latest ``ok`` extraction per text_hash for this extractor."""
    rows = read_rows(
        store,
        ExtractionRow,
        filter=(pc.field("extractor_fp") == extractor_fp) & (pc.field("status") == "ok"),
    )
    return {r.text_hash: r for r in rows}


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
            candidates=list(r.candidates) if r.status == "ok" else [],
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
    progress: Callable[[int], None] | None = None,
) -> ExtractBatch:
    """Ask the extractor about one batch of requests; write nothing."""
    results = extractor.extract(requests, progress)
    return ExtractBatch(*result_rows(results, extractor, run_id))


def publish_extraction(
    store: Store, batch: ExtractBatch, run_id: str, counts: ExtractCounts
) -> None:
    """Append a batch's ledger rows, then its answers (the writer of the store calls this).

    A batch computed by an earlier run (a Prefect cache hit) may already be in the tables, if
    that run got to write it: rows already there (same call_id; same text_hash and run_id) are
    not written twice. ``counts`` gets the batch's answers and the calls made by ``run_id``.
    """
    answers, calls = batch.answers, batch.calls
    earlier = sorted(({r.run_id for r in answers} | {c.run_id for c in calls}) - {run_id})
    if earlier:
        in_earlier = pc.field("run_id").isin(earlier)
        have_calls = {c.call_id for c in read_rows(store, ExtractionCallRow, filter=in_earlier)}
        have = {(a.text_hash, a.run_id) for a in read_rows(store, ExtractionRow, filter=in_earlier)}
        calls = [c for c in calls if c.call_id not in have_calls]
        answers = [a for a in answers if (a.text_hash, a.run_id) not in have]
    append_rows(store, calls, run_id, "extract-calls")
    append_rows(store, answers, run_id, "extract")
    mine = [c for c in batch.calls if c.run_id == run_id]
    counts.ok += sum(a.status == "ok" for a in batch.answers)
    counts.failed += sum(a.status != "ok" for a in batch.answers)
    counts.calls += len(mine)
    counts.tokens_in += sum(c.tokens_in for c in mine)
    counts.tokens_out += sum(c.tokens_out for c in mine)
    counts.cost_usd += sum(c.cost_usd for c in mine)


def extract_requests(
    store: Store,
    extractor: Extractor,
    requests: Sequence[ExtractionRequest],
    run_id: str,
    counts: ExtractCounts,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run one batch of requests and append its answers and ledger rows (both, or neither)."""
    publish_extraction(store, run_extraction(extractor, requests, run_id, progress), run_id, counts)
