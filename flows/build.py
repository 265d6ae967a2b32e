"""The build flow: the whole DAG on one screen.

```
ingest -> chunk -> extract -> recover -> kv -> embed+index -> summary
```

Each stage asks the store which of its keys already exist for the current fingerprints and
computes only the rest, so rebuilding an unchanged corpus makes no LLM call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner
from prefect.utilities.annotations import quote

from coinrag.flows.progress import ProgressLog, result_with_ticks
from coinrag.flows.scaleout import embed_on_workers, kv_on_workers, task_runner
from coinrag.inference.kv_dtype import resolve_kv_dtype
from coinrag.inference.models import load_tokenizer, tokenizer_fingerprint
from coinrag.schemas.keys import new_run_id
from coinrag.schemas.settings import BuildSettings
from coinrag.schemas.tables import EXTRACTION_ABANDONED
from coinrag.storage.publish import begin, publish
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store
from coinrag.tasks.chunk import chunk_stage, chunker_fingerprint
from coinrag.tasks.delete import prune_stage
from coinrag.tasks.embed import EmbedParts
from coinrag.tasks.extract import (
    ExtractBatch,
    ExtractCounts,
    ExtractionWriter,
    abandon_repeated,
    answered_ok,
    pending_requests,
    run_extraction,
    settled_answers,
    stage_result,
)
from coinrag.tasks.extractors.base import ExtractionRequest
from coinrag.tasks.extractors.factory import make_extractor
from coinrag.tasks.ingest import ingest_stage
from coinrag.tasks.recover import current_nuggets, recover_stage


@task(name="ingest", cache_policy=NO_CACHE)
def ingest_task(store: Store, source: str, run_id: str):
    return ingest_stage(store, source, run_id)


@task(name="prune", cache_policy=NO_CACHE)
def prune_task(store: Store, ingested: Any, run_id: str) -> dict[str, str]:
    rejected = [r.doc_id for r in ingested.rejects]
    return prune_stage(store, ingested.documents, rejected, run_id)


@task(name="chunk", cache_policy=NO_CACHE)
def chunk_task(store: Store, documents: list, settings: BuildSettings, run_id: str):
    tokenizer = load_tokenizer(settings.model)
    return chunk_stage(
        store,
        documents,
        tokenizer,
        tokenizer_fp=tokenizer_fingerprint(tokenizer),
        chunk_size=settings.chunk_size,
        method=settings.chunker,
        run_id=run_id,
    )


# No Prefect cache: the `extractions` table is the response cache, and a cached task result
# would hide the failures it records from the next build (issue 12).
@task(
    name="extract", retries=2, retry_delay_seconds=5, tags=["llm-endpoint"], cache_policy=NO_CACHE
)
def extract_task(
    store: Store, settings: BuildSettings, requests: list[ExtractionRequest], run_id: str
) -> ExtractBatch:
    """One batch, computed wherever the task runner puts it: each answer staged in the store as
    it arrives (a kill loses none), all of them returned; the flow writes the tables."""
    extractor = make_extractor(settings, str(store.prefect_dir))
    staged = partial(stage_result, store, extractor, run_id) if extractor.stage_answers else None
    return run_extraction(extractor, requests, run_id, staged)


@task(name="recover", cache_policy=NO_CACHE)
def recover_task(store: Store, chunks: list, extractor_fp: str, tau: float, run_id: str):
    return recover_stage(store, chunks, answered_ok(store, extractor_fp), extractor_fp, tau, run_id)


@task(name="kv-space", cache_policy=NO_CACHE)
def kv_space_task(store: Store, chunks: list, settings: BuildSettings) -> None:
    """Refuse the build (``tasks.kv_space.KvSpaceError``) before extraction when the KV it
    would add does not fit on the store's file system."""
    from coinrag.tasks.kv_space import check_kv_space

    estimate = check_kv_space(store, chunks, settings, load_tokenizer(settings.model))
    get_run_logger().info(
        "kv: %d new entries, %d bytes projected, %s bytes free",
        estimate.entries,
        estimate.projected_bytes,
        "not checked (object store)" if estimate.free_bytes is None else estimate.free_bytes,
    )


@task(name="kv", cache_policy=NO_CACHE)
def kv_task(
    store: Store, chunks: list, settings: BuildSettings, run_id: str, extractor_fp: str
) -> dict[str, Any]:
    from coinrag.inference.models import load_shared_model
    from coinrag.inference.prompt import RagPrompt
    from coinrag.tasks.kv import build_kept_ranges, kv_stage

    logger = get_run_logger()
    kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device)
    logger.info("kv: %s (%s)", kv_dtype.dtype, kv_dtype.reason)
    loaded = load_shared_model(settings.model, settings.device, kv_dtype.dtype)
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        rate = (time.monotonic() - started) / max(done, 1)
        logger.info(
            "kv: %d/%d chunks, %.2f s each, about %.0f s left",
            done,
            total,
            rate,
            rate * (total - done),
        )

    counts = kv_stage(
        store,
        chunks,
        loaded,
        RagPrompt.for_tokenizer(loaded.tokenizer),
        run_id,
        batch_size=settings.kv_batch_size,
        progress=progress,
        check=settings.kv_verify,
        kept=build_kept_ranges(store, chunks, settings.kv_keep, extractor_fp, settings.tau),
        kv_codec=settings.kv_codec,
    )
    return {"model_fp": loaded.model_fp, "kv_dtype": kv_dtype.dtype, **counts.as_dict()}


@task(name="embed-index", cache_policy=NO_CACHE)
def embed_task(
    store: Store,
    chunks: list,
    documents: list,
    settings: BuildSettings,
    extractor_fp: str,
    run_id: str,
) -> dict[str, Any]:
    return _embed_index(store, chunks, documents, settings, extractor_fp, run_id)


def _embed_index(
    store: Store,
    chunks: list,
    documents: list,
    settings: BuildSettings,
    extractor_fp: str,
    run_id: str,
    embed_parts: EmbedParts | None = None,
) -> dict[str, Any]:
    """Embed and index (``embed_parts``: where the vectors are computed, default here)."""
    from coinrag.inference.embedders import load_embedder
    from coinrag.tasks.embed import embed_stage

    logger = get_run_logger()
    embedder = load_embedder(settings.embedder)
    nuggets = current_nuggets(store, [c.chunk_id for c in chunks], extractor_fp, settings.tau)

    progress = ProgressLog(logger, "embed", "texts", 0)
    counts = embed_stage(
        store,
        chunks,
        nuggets,
        documents,
        embedder,
        run_id,
        progress.update,
        part_size=settings.embed_batch_size,
        embed_parts=embed_parts,
    )
    return {"embedder_fp": embedder.fingerprint, **asdict(counts)}


def _extract_all(
    runner: TaskRunner, store: Store, settings: BuildSettings, chunks: list, run_id: str
) -> tuple[ExtractCounts, str, str]:
    """Send every unanswered chunk text to the extractor, one task per batch on ``runner``.

    Answers a killed build staged are written first (never asked again); then the flow writes
    the answers as the tasks stage them, reporting progress per answered chunk text. Return the
    counts, the extractor's fingerprint and its prompt version."""
    logger = get_run_logger()
    extractor = make_extractor(settings, str(store.prefect_dir))
    fp = extractor.fingerprint
    total = ExtractCounts()
    writer = ExtractionWriter(store, run_id, total)
    kept = writer.flush()
    if kept:
        logger.info("extract: kept %d answer(s) an interrupted build had received", kept)
    settled = settled_answers(store, fp, settings.retry_abandoned)
    pending = pending_requests(chunks, settled)
    texts = {c.text_hash for c in chunks}
    total.requested = len(pending)
    total.abandoned_before = sum(  # abandoned by an earlier build
        settled[t].status == EXTRACTION_ABANDONED for t in texts if t in settled
    )
    total.cached = len(texts) - len(pending) - total.abandoned_before
    if total.abandoned_before:
        logger.info(
            "extract: %d chunk texts not asked: abandoned by an earlier build "
            "(coinrag build --retry-abandoned asks again)",
            total.abandoned_before,
        )
    if pending:
        logger.info(
            "extract: %d chunk texts to ask %s %s (%d answered before)",
            len(pending),
            extractor.backend,
            extractor.llm_model,
            total.cached,
        )
    size = len(pending) if extractor.takes_all_at_once else settings.extract_batch_size
    progress = ProgressLog(logger, "extract", "chunk texts", len(pending), artifact="extraction")
    batches = [pending[i : i + size] for i in range(0, len(pending), max(size, 1))]
    futures = [
        runner.submit(
            extract_task,
            {"store": store, "settings": settings, "requests": batch, "run_id": run_id},
        )
        for batch in batches
    ]
    for future in futures:
        batch = result_with_ticks(future, lambda: progress.update(writer.answered()))
        writer.flush(batch)
        progress.update(writer.answered())
    if total.malformed:
        abandon_repeated(store, fp, run_id, settings.abandon_after, total)
    return total, fp, extractor.prompt_version


def _kv_all(
    runner: TaskRunner,
    store: Store,
    chunks: list,
    settings: BuildSettings,
    run_id: str,
    extractor_fp: str,
) -> dict[str, Any]:
    """The KV stage: in the flow process (default runner), else one task per group of chunks
    on the runner's workers (flows/scaleout.py); the same entries either way. With ``kv_keep
    = "nuggets"`` only the token ranges of the chunks' nuggets (by ``extractor_fp``) are
    stored."""
    if settings.runner == "default":
        kv = kv_task(store, quote(chunks), settings, run_id, extractor_fp)
    else:
        kv = kv_on_workers(runner, store, chunks, settings, run_id, extractor_fp)
    problems = kv.get("problems", {})  # stored entries (or C_p) that failed their check
    logger = get_run_logger()
    for key, problem in list(problems.items())[:20]:
        logger.warning("kv: %s failed its check, recomputed: %s", key, problem)
    if len(problems) > 20:
        logger.warning("kv: ... and %d more entries rebuilt", len(problems) - 20)
    return kv


def _embed_all(
    runner: TaskRunner,
    store: Store,
    chunks: list,
    documents: list,
    settings: BuildSettings,
    extractor_fp: str,
    run_id: str,
) -> dict[str, Any]:
    """Embed + index: one task in the flow process (default runner), else the flow writes the
    cache and index while one task per part of the texts computes vectors on the workers."""
    if settings.runner == "default":
        return embed_task(store, quote(chunks), quote(documents), settings, extractor_fp, run_id)
    parts = partial(embed_on_workers, runner, settings)
    return _embed_index(store, chunks, documents, settings, extractor_fp, run_id, parts)


class StageClock:
    """Wall seconds per build stage: ``with clock("kv"): ...`` adds to ``clock.seconds["kv"]``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self.seconds[stage] = round(self.seconds.get(stage, 0.0) + elapsed, 3)


@flow(name="coinrag-build")
def build_flow(source: str, store: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build (or update) STORE from SOURCE; return the summary counts, with ``rejected`` (the
    rejected records), ``failures`` (one line per kind of work that failed and that the next
    build retries, e.g. chunk texts the extractor could not answer; empty when all was built)
    and ``warnings`` (work settled as not worth asking again: chunk texts abandoned after
    malformed replies in ``abandon_after`` builds)."""
    s = BuildSettings(**(settings or {})).validate()
    from coinrag.inference.threads import set_process_threads

    set_process_threads(s.threads)  # this process's torch/BLAS pools (a served build's too)
    st = Store.at(store).init()
    run_id = new_run_id("build")
    logger = get_run_logger()
    params = {"source": str(Path(source).expanduser().resolve()), **s.to_dict()}
    params["extractor"] = s.resolved_extractor()
    with st.write_lock(run_id), task_runner(s) as runner:
        begin(st)
        run = start_run(st, run_id, "build", params)
        clock = StageClock()
        with failing_run(st, run):
            with clock("ingest"):
                ingested, n_new_docs = ingest_task(st, source, run_id)
            with clock("prune"):
                pruned = prune_task(st, quote(ingested), run_id) if s.prune else {}
            with clock("chunk"):
                chunks, n_new_chunks = chunk_task(st, quote(ingested.documents), s, run_id)
                if s.kv and s.kv_space_check:  # before any LLM call or forward pass
                    kv_space_task(st, quote(chunks), s)
            with clock("extract"):
                extracted, extractor_fp, prompt_version = _extract_all(
                    runner, st, s, chunks, run_id
                )
            with clock("recover"):
                recovered = recover_task(st, quote(chunks), extractor_fp, s.tau, run_id)
            with clock("kv"):
                kv = _kv_all(runner, st, chunks, s, run_id, extractor_fp) if s.kv else {}
            with clock("embed_index"):
                index = (
                    _embed_all(runner, st, chunks, ingested.documents, s, extractor_fp, run_id)
                    if s.index
                    else {}
                )
        # kv_dtype "auto" is resolved where the KV is computed (here when no KV was); record
        # what it became, so readers load the model in the dtype of the stored KV.
        params["kv_dtype"] = kv.get("kv_dtype") or resolve_kv_dtype(s.kv_dtype, s.device).dtype
        summary = {
            "run_id": run_id,
            "documents": len(ingested.documents),
            "documents_new": n_new_docs,
            "documents_pruned": len(pruned),
            "rejects": len(ingested.rejects),
            "chunks": len(chunks),
            "chunks_new": n_new_chunks,
            "extract_requested": extracted.requested,
            "extract_cached": extracted.cached,
            "extract_ok": extracted.ok,
            "extract_failed": extracted.failed,
            "extract_malformed": extracted.malformed,
            "extract_salvaged": extracted.salvaged,
            "extract_abandoned": extracted.abandoned,
            "extract_abandoned_before": extracted.abandoned_before,
            "llm_calls": extracted.calls,
            "tokens_in": extracted.tokens_in,
            "tokens_out": extracted.tokens_out,
            "cost_usd": round(extracted.cost_usd, 6),
            "nuggets_exact": recovered.exact,
            "nuggets_fuzzy": recovered.fuzzy,
            "abandoned": recovered.abandoned,
            "kv_computed": kv.get("computed", 0),
            "kv_reused": kv.get("reused", 0),
            "kv_rebuilt": kv.get("rebuilt", 0),
            "kv_disk_bytes": kv.get("disk_bytes", 0),
            "kv_nothing_kept": kv.get("nothing_kept", 0),
            "kv_dtype": params["kv_dtype"],
            "kv_keep": s.kv_keep,
            "embedded": index.get("embedded", 0),
            "embeddings_cached": index.get("cached", 0),
            "stage_seconds": clock.seconds,
        }
        fingerprints = {
            "tokenizer_fp": chunks[0].tokenizer_fp if chunks else "",
            "chunker_fp": chunker_fingerprint(s.chunker, s.chunk_size),
            "extractor_fp": extractor_fp,
            "prompt_version": prompt_version,
            "model_fp": kv.get("model_fp", ""),
            "kv_fp": kv.get("kv_fp", ""),
            "embedder_fp": index.get("embedder_fp", ""),
        }
        # The commit point: one atomic write publishes the index versions, the settings and
        # this run's rows (storage/publish.py); a build killed before it changed nothing.
        publish(
            st,
            run_id,
            "build",
            s.to_dict() | {"extractor": params["extractor"], "kv_dtype": params["kv_dtype"]},
            index=s.index or bool(pruned),
        )
        # Work that failed but may succeed when asked again (the next build retries it): the
        # run is committed, and its row says what is missing. Work settled as abandoned is
        # a warning (the build did all it will do).
        failures = [
            line
            for line in (
                extracted.failure_line(),
                extracted.malformed_line(s.abandon_after),
            )
            if line
        ]
        warnings = [line for line in (extracted.abandoned_line(s.abandon_after),) if line]
        finish_run(
            st,
            run,
            "completed",
            fingerprints=fingerprints,
            counts=summary,
            cost_usd=extracted.cost_usd,
            error="; ".join(failures) or None,
            parameters=params,
        )
        create_table_artifact(
            table=[{"measure": k, "value": str(v)} for k, v in summary.items()],
            key="build-summary",
            description=f"coinrag build {run_id}",
        )
        logger.info("build %s done: %s", run_id, summary)
        for line in failures:
            logger.warning("%s; the next build retries them", line)
        if warnings:  # the CLI prints the warning line itself
            logger.info("extract: %d chunk text(s) abandoned", extracted.abandoned)
        summary["rejected"] = [asdict(r) for r in ingested.rejects]
        summary["failures"] = failures
        summary["warnings"] = warnings
        return summary
