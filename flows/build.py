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
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from coinrag.flows.progress import ProgressLog, result_with_ticks
from coinrag.flows.scaleout import Runner, task_runner
from coinrag.inference.model.kv_dtype import resolve_kv_dtype
from coinrag.inference.model.loading import load_tokenizer, tokenizer_fingerprint
from coinrag.schemas.keys import new_run_id
from coinrag.schemas.settings import BuildSettings
from coinrag.schemas.tables import EXTRACTION_ABANDONED, ChunkRow
from coinrag.storage.kv import KeptRanges
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
from coinrag.tasks.ingest import IngestResult, ingest_stage
from coinrag.tasks.ingest_files import ReadOptions
from coinrag.tasks.kv import KvOptions, KvWorkers, build_kept_ranges, run_kv_stage
from coinrag.tasks.recover.stage import RecoverCounts, current_nuggets, recover_stage


@task(name="ingest", cache_policy=NO_CACHE)
def ingest_task(store: Store, source: str, settings: BuildSettings, run_id: str):
    return ingest_stage(store, source, run_id, ReadOptions.from_settings(settings))


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
    store: Store,
    chunks: list,
    settings: BuildSettings,
    run_id: str,
    kept: dict[str, KeptRanges] | None,
    workers: KvWorkers,
) -> dict[str, Any]:
    """The KV stage (``tasks.kv.run_kv_stage``), its model work done by ``workers``."""
    progress = ProgressLog(get_run_logger(), "kv", "chunks", 0)
    options = KvOptions.from_settings(settings)
    return run_kv_stage(store, chunks, workers, run_id, options, progress, kept=kept).as_dict()


@task(name="embed-index", cache_policy=NO_CACHE)
def embed_task(
    store: Store,
    chunks: list,
    documents: list,
    settings: BuildSettings,
    extractor_fp: str,
    run_id: str,
    parts: EmbedParts | None = None,
) -> dict[str, Any]:
    """Embed and index (``tasks.embed.embed_stage``; ``parts``: where the vectors are computed,
    None: here)."""
    from coinrag.inference.retrieval.embedders import store_embedder_of
    from coinrag.tasks.embed import EmbedOptions, embed_stage

    embedder = store_embedder_of(settings)
    nuggets = current_nuggets(store, [c.chunk_id for c in chunks], extractor_fp, settings.tau)
    progress = ProgressLog(get_run_logger(), "embed", "texts", 0)
    options = EmbedOptions.from_settings(settings, parts)
    counts = embed_stage(store, chunks, nuggets, documents, embedder, run_id, options, progress)
    return {"embedder_fp": embedder.fingerprint, **asdict(counts)}


def _extract_all(
    runner: Runner, store: Store, settings: BuildSettings, chunks: list, run_id: str
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


def run_kv(
    runner: Runner,
    store: Store,
    chunks: list,
    settings: BuildSettings,
    run_id: str,
    extractor_fp: str,
) -> dict[str, Any]:
    """The KV stage on ``runner`` (:meth:`~flows.scaleout.Runner.stage`, its model work on
    :meth:`~flows.scaleout.Runner.kv_workers`); the same entries whatever the runner. With
    ``kv_keep = "nuggets"`` only the token ranges of the chunks' nuggets (by ``extractor_fp``)
    are stored. Returns ``tasks.kv.KvCounts`` as a dict."""
    kept = build_kept_ranges(store, chunks, settings.kv_keep, extractor_fp, settings.tau)
    kv = runner.stage(
        kv_task,
        store=store,
        chunks=chunks,
        settings=settings,
        run_id=run_id,
        kept=kept,
        workers=runner.kv_workers(),
    )
    problems = kv.get("problems", {})  # stored entries (or C_p) that failed their check
    logger = get_run_logger()
    for key, problem in list(problems.items())[:20]:
        logger.warning("kv: %s failed its check, recomputed: %s", key, problem)
    if len(problems) > 20:
        logger.warning("kv: ... and %d more entries rebuilt", len(problems) - 20)
    return kv


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


@dataclass
class BuildOutputs:
    """What the stages of one build did (:func:`run_stages`)."""

    ingested: IngestResult
    documents_new: int
    pruned: dict[str, str]
    chunks: list[ChunkRow]
    chunks_new: int
    extracted: ExtractCounts
    extractor_fp: str
    prompt_version: str
    recovered: RecoverCounts
    kv: dict[str, Any]  # tasks.kv.KvCounts as a dict ({} without KV)
    index: dict[str, Any]  # tasks.embed.EmbedCounts as a dict ({} without an index)

    def failures(self, s: BuildSettings) -> list[str]:
        """Work that failed but may succeed when asked again (the next build retries it)."""
        lines = (self.extracted.failure_line(), self.extracted.malformed_line(s.abandon_after))
        return [line for line in lines if line]

    def warnings(self, s: BuildSettings) -> list[str]:
        """Work settled as abandoned: the build did all it will do."""
        return [line for line in (self.extracted.abandoned_line(s.abandon_after),) if line]

    def fingerprints(self, s: BuildSettings) -> dict[str, str]:
        """The identities of what was built (the ``runs`` row's ``fingerprints``)."""
        return {
            "tokenizer_fp": self.chunks[0].tokenizer_fp if self.chunks else "",
            "chunker_fp": chunker_fingerprint(s.chunker, s.chunk_size),
            "extractor_fp": self.extractor_fp,
            "prompt_version": self.prompt_version,
            "model_fp": self.kv.get("model_fp", ""),
            "kv_fp": self.kv.get("kv_fp", ""),
            "embedder_fp": self.index.get("embedder_fp", ""),
        }

    def summary(self, run_id: str, s: BuildSettings, kv_dtype: str) -> dict[str, Any]:
        """The build's summary counts (without ``stage_seconds``, ``rejected``, ...)."""
        extracted, recovered, kv, index = self.extracted, self.recovered, self.kv, self.index
        return {
            "run_id": run_id,
            "documents": len(self.ingested.documents),
            "documents_new": self.documents_new,
            "documents_parsed": self.ingested.parsed,  # files a reader read now
            "files_skipped": self.ingested.skipped,  # hidden, excluded or of no known format
            "files_left_out": len(self.ingested.left_out),  # read, but not documents (links)
            "documents_pruned": len(self.pruned),
            "rejects": len(self.ingested.rejects),
            "chunks": len(self.chunks),
            "chunks_new": self.chunks_new,
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
            # int2basis: "new" or "replaced" where this run calibrated and stored a key basis
            **({"kv_basis": kv["basis_written"]} if kv.get("basis_written") else {}),
            "kv_dtype": kv_dtype,
            "kv_keep": s.kv_keep,
            "embedded": index.get("embedded", 0),
            "embeddings_cached": index.get("cached", 0),
        }


def run_stages(
    runner: Runner, st: Store, source: str, s: BuildSettings, run_id: str, clock: StageClock
) -> BuildOutputs:
    """ingest -> prune -> chunk -> extract -> recover -> kv -> embed+index, each timed by
    ``clock``."""
    with clock("ingest"):
        ingested, documents_new = ingest_task(st, source, s, run_id)
    with clock("prune"):
        pruned = prune_task(st, quote(ingested), run_id) if s.prune else {}
    with clock("chunk"):
        chunks, chunks_new = chunk_task(st, quote(ingested.documents), s, run_id)
        if s.kv and s.kv_space_check:  # before any LLM call or forward pass
            kv_space_task(st, quote(chunks), s)
    with clock("extract"):
        extracted, extractor_fp, prompt_version = _extract_all(runner, st, s, chunks, run_id)
    with clock("recover"):
        recovered = recover_task(st, quote(chunks), extractor_fp, s.tau, run_id)
    with clock("kv"):
        kv = run_kv(runner, st, chunks, s, run_id, extractor_fp) if s.kv else {}
    with clock("embed_index"):
        index = (
            runner.stage(
                embed_task,
                store=st,
                chunks=chunks,
                documents=ingested.documents,
                settings=s,
                extractor_fp=extractor_fp,
                run_id=run_id,
                parts=runner.embed_parts(),
            )
            if s.index
            else {}
        )
    return BuildOutputs(
        ingested,
        documents_new,
        pruned,
        chunks,
        chunks_new,
        extracted,
        extractor_fp,
        prompt_version,
        recovered,
        kv,
        index,
    )


def _keep_adapted_embedder(st: Store, s: BuildSettings) -> BuildSettings:
    """``s`` with the store's adapted embedder where it was adapted from ``s.embedder``
    (``embedders.adapted_embedder``: incremental builds keep what `train retriever` made)."""
    from dataclasses import replace

    from coinrag.inference.retrieval.embedders import adapted_embedder

    recorded = (st.read_toml().get("build") or {}).get("embedder")
    chosen = adapted_embedder(recorded, s.embedder)
    if chosen != s.embedder:
        get_run_logger().info("embedder %s: the store's, adapted from %s", chosen, s.embedder)
    return replace(s, embedder=chosen) if chosen != s.embedder else s


@flow(name="coinrag-build")
def build_flow(source: str, store: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build (or update) STORE from SOURCE; return the summary counts, with ``rejected`` (the
    rejected records), ``failures`` (one line per kind of work that failed and that the next
    build retries, e.g. chunk texts the extractor could not answer; empty when all was built)
    and ``warnings`` (work settled as not worth asking again: chunk texts abandoned after
    malformed replies in ``abandon_after`` builds)."""
    s = BuildSettings(**(settings or {})).validate()
    from coinrag.inference.model.threads import set_process_threads

    set_process_threads(s.threads)  # this process's torch/BLAS pools (a served build's too)
    st = Store.at(store).init()
    s = _keep_adapted_embedder(st, s)
    run_id = new_run_id("build")
    params = {"source": str(Path(source).expanduser().resolve()), **s.to_dict()}
    params["extractor"] = s.resolved_extractor()
    with st.write_lock(run_id), task_runner(s) as runner:
        begin(st)
        run = start_run(st, run_id, "build", params)
        clock = StageClock()
        with failing_run(st, run):
            out = run_stages(runner, st, source, s, run_id, clock)
        # kv_dtype "auto" is resolved where the KV is computed (here when no KV was); record
        # what it became, so readers load the model in the dtype of the stored KV.
        params["kv_dtype"] = out.kv.get("kv_dtype") or resolve_kv_dtype(s.kv_dtype, s.device).dtype
        summary = out.summary(run_id, s, params["kv_dtype"]) | {"stage_seconds": clock.seconds}
        # The commit point: one atomic write publishes the index versions, the settings and
        # this run's rows (storage/publish.py); a build killed before it changed nothing.
        publish(
            st,
            run_id,
            "build",
            s.to_dict() | {"extractor": params["extractor"], "kv_dtype": params["kv_dtype"]},
            index=s.index or bool(out.pruned),
        )
        # Work that failed but may succeed when asked again: the run is committed, and its row
        # says what is missing.
        failures = out.failures(s)
        finish_run(
            st,
            run,
            "completed",
            fingerprints=out.fingerprints(s),
            counts=summary,
            cost_usd=out.extracted.cost_usd,
            error="; ".join(failures) or None,
            parameters=params,
        )
        _report(run_id, summary, failures, out.extracted.abandoned)
        summary["rejected"] = [asdict(r) for r in out.ingested.rejects]
        summary["left_out"] = [asdict(r) for r in out.ingested.left_out]
        summary["failures"] = failures
        summary["warnings"] = out.warnings(s)
        return summary


def _report(run_id: str, summary: dict[str, Any], failures: list[str], abandoned: int) -> None:
    """The build's summary artifact and closing log lines."""
    create_table_artifact(
        table=[{"measure": k, "value": str(v)} for k, v in summary.items()],
        key="build-summary",
        description=f"coinrag build {run_id}",
    )
    logger = get_run_logger()
    logger.info("build %s done: %s", run_id, summary)
    for line in failures:
        logger.warning("%s; the next build retries them", line)
    if abandoned:  # the CLI prints the warning line itself
        logger.info("extract: %d chunk text(s) abandoned", abandoned)
