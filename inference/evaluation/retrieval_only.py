"""Retrieval-only evaluation: which gold documents each search mode finds, without the generation
model or KV.

For stores built without KV (``kv = false``: a corpus too large for the disk, or one whose KV is
not built yet), for sweeping ``kc`` / ``k`` cheaply, and for comparing the search modes
(``dense``, ``lexical``, ``hybrid``: ``inference.retrieval.retriever.SEARCH_MODES``) side by side.
Per question with gold ``doc_ids``, per search mode, the evidence kinds:

- ``chunks``: the documents of the top-``kc`` chunks (TurboRAG's and standard RAG's evidence);
- ``two_stage``: the documents of the top-``k`` nuggets inside those chunks (CoinRAG's evidence);
- ``one_stage``: the documents of the top-``k`` nuggets over the whole nugget table (ablation).

``hit`` is 1 when a gold document is among those documents (hit@kc for chunks: a question whose
answer several pages give counts as found when one of them is); ``recall`` is the fraction of
the question's gold documents among them (the same measure as
:func:`inference.evaluation.evaluate.doc_recall`; equal to ``hit`` with one gold document). ``rank``
is the 1-based rank of the first retrieved item of a gold document (null when none is there): among
the top ``kc`` chunks for ``chunks``, among the retrieved nuggets by score (best first) for the
nugget kinds; ``mrr`` is the mean of ``1 / rank`` (0 for none): MRR@kc for chunks, MRR@k for
nuggets. ``search_ms`` is query embedding + index searches (+ fusion for hybrid) + reranking.

``rerank`` (default: the store's ``rerank`` setting) reorders each search's top chunks
(``inference.retrieval.rerank``; recorded in ``eval_run.json``). A reranker scores a question's
chunks once (memoised), so in a kc sweep the first kc pays its time and the others reuse it:
its latency is measured by ``tests/benchmarks/bench_rerank.py``.

Outputs under ``out_dir`` (schemas in ``schemas/evaluation.py``): ``retrieval.parquet`` (one row
per dataset, search mode, evidence kind and (kc, k)), ``retrieval_per_question.parquet`` and
``eval_run.json`` (the store's published versions read, the question files' sha256, the modes:
``inference.evaluation.evaluate.write_eval_run``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coinrag.inference.evaluation.evaluate import doc_recall, write_eval_run
from coinrag.inference.evaluation.report import p99
from coinrag.schemas.evaluation import RETRIEVAL_PER_QUESTION_SCHEMA, RETRIEVAL_SCHEMA
from coinrag.schemas.qa import load_questions
from coinrag.schemas.settings import DEFAULT_QUERY, RETRIEVAL_MODES

EVIDENCE_KINDS = ("chunks", "two_stage", "one_stage")


def first_gold_rank(chunk_doc_ids: Sequence[str], gold: Sequence[str]) -> int | None:
    """1-based rank of the first chunk whose document is gold; None if there is none."""
    wanted = set(gold)
    for i, doc_id in enumerate(chunk_doc_ids, start=1):
        if doc_id in wanted:
            return i
    return None


def nugget_rank(result: Any, gold: Sequence[str]) -> int | None:
    """:func:`first_gold_rank` of a nugget result's evidence in score order (the evidence
    itself is in assembly order: by chunk, then in-document order)."""
    by_score = sorted(result.evidence, key=lambda e: -e.score)
    return first_gold_rank([e.doc_id for e in by_score], gold)


def aggregate_retrieval(rows: list[dict[str, Any]]) -> pa.Table:
    """Per-question rows -> one row per (dataset, retrieval, evidence, kc, k)."""
    keys = ("dataset", "retrieval", "evidence", "kc", "k")
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[key] for key in keys), []).append(r)
    out = []
    for key, rs in groups.items():
        ms = [r["search_ms"] for r in rs]
        out.append(
            {
                **dict(zip(keys, key, strict=True)),
                "hit": float(np.mean([r["hit"] for r in rs])),
                "recall": float(np.mean([r["recall"] for r in rs])),
                "mrr": float(np.mean([1.0 / r["rank"] if r["rank"] else 0.0 for r in rs])),
                "search_mean_ms": float(np.mean(ms)),
                "search_p99_ms": p99(ms),
                "n": len(rs),
            }
        )
    return pa.Table.from_pylist(out, schema=RETRIEVAL_SCHEMA)


RETRIEVAL_KCS = (1, 2, 4, 8)  # the kc values `eval --retrieval-only` sweeps by default


def evaluate_retrieval(
    store_path: str | Path,
    questions_path: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    kcs: Sequence[int] = RETRIEVAL_KCS,
    ks: Sequence[int] = (DEFAULT_QUERY.k,),
    evidence: Sequence[str] = EVIDENCE_KINDS,
    *,
    retrievals: Sequence[str] = RETRIEVAL_MODES,
    embedder: str | None = None,
    limit: int | None = None,
    rerank: str | None = None,
) -> pa.Table:
    """Hits and recall of gold documents for each question file (``questions_path``: one or
    several; ``dataset``: a file's stem), search mode, evidence kind and (kc, k); write the
    outputs; return the table.

    Only questions with gold ``doc_ids`` count (a file without any raises ``ValueError``). On an
    index without nuggets (extractor ``none``) only the ``chunks`` kind runs. ``embedder``
    defaults to the store's; a different one than the index's is refused. Each search mode is
    warmed up once (untimed) before the timed queries.
    """
    from coinrag.inference.context.rerank import store_reranker
    from coinrag.inference.retrieval.embedders import store_embedder_of
    from coinrag.inference.retrieval.retriever import Retriever, search_mode
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.store import Store

    bad = [m for m in evidence if m not in EVIDENCE_KINDS]
    if bad or not evidence:
        raise ValueError(f"evidence kinds must be among {', '.join(EVIDENCE_KINDS)}; got {bad}")
    modes = [search_mode(m) for m in dict.fromkeys(retrievals)]
    if not modes:
        raise ValueError(f"no search mode: give some of {', '.join(RETRIEVAL_MODES)}")
    if not kcs or not ks or min(kcs) < 1 or min(ks) < 1:
        raise ValueError("kc and k values must be >= 1")
    paths = [questions_path] if isinstance(questions_path, str | Path) else list(questions_path)
    datasets = _datasets(paths, limit)
    store = Store.at(store_path)
    if not store.exists():
        raise FileNotFoundError(f"{store} is not a coinrag store (run coinrag build first)")
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    reranker = store_reranker(rerank or settings.rerank, store, settings)
    retriever = Retriever(store, store_embedder_of(settings, embedder), reranker=reranker)
    if retriever.index.count("nuggets") == 0:  # e.g. built with extractor "none"
        evidence = [m for m in evidence if m == "chunks"]
        if not evidence:
            raise ValueError(f"{store}: the index holds no nuggets; use the chunks kind")
    first = datasets[0][1][0].question
    for mode in modes:  # warm-up: lazy loads and first-query costs, untimed
        retriever.two_stage(first, kc=1, k=1, mode=mode)
    rows = [
        _row(qi, dataset, q, key, result, rank)
        for (dataset, questions), mode in itertools.product(datasets, modes)
        for qi, q in enumerate(questions)
        for key, result, rank in _searches(retriever, q, mode, evidence, kcs, ks)
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = aggregate_retrieval(rows)
    pq.write_table(
        pa.Table.from_pylist(rows, schema=RETRIEVAL_PER_QUESTION_SCHEMA),
        out / "retrieval_per_question.parquet",
    )
    pq.write_table(results, out / "retrieval.parquet")
    write_eval_run(
        out,
        store,
        paths,
        kind="retrieval",
        retrievals=[m.name for m in modes],
        evidence=list(evidence),
        kcs=sorted(set(kcs)),
        ks=sorted(set(ks)),
        embedder_fp=retriever.embedder.fingerprint,
        rerank=retriever.reranker.record() if retriever.reranker is not None else {"name": "none"},
    )
    return results


def _datasets(paths: Sequence[str | Path], limit: int | None) -> list[tuple[str, list[Any]]]:
    """Each question file's stem and its questions with gold ``doc_ids`` (the first ``limit``);
    a file without any is a ValueError."""
    datasets = []
    for path in paths:
        questions = [q for q in load_questions(path) if q.doc_ids]
        if limit is not None:
            questions = questions[:limit]
        if not questions:
            raise ValueError(f"{path}: no question has gold doc_ids")
        datasets.append((Path(path).stem, questions))
    return datasets


def _searches(
    retriever: Any,
    q: Any,
    mode: Any,
    evidence: Sequence[str],
    kcs: Sequence[int],
    ks: Sequence[int],
) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
    """Every search of question ``q`` in ``mode``: ((mode, kind, kc, k), result, first gold
    rank), per evidence kind and (kc, k)."""
    gold = q.doc_ids or []
    if "chunks" in evidence:
        for kc in sorted(set(kcs)):
            res = retriever.chunks_only(q.question, kc=kc, mode=mode)
            yield (
                (mode.name, "chunks", kc, 0),
                res,
                first_gold_rank([h.doc_id for h in res.chunks], gold),
            )
    for k in sorted(set(ks)):
        if "two_stage" in evidence:
            for kc in sorted(set(kcs)):
                res = retriever.two_stage(q.question, kc=kc, k=k, mode=mode)
                yield (mode.name, "two_stage", kc, k), res, nugget_rank(res, gold)
        if "one_stage" in evidence:
            res = retriever.one_stage(q.question, k=k, mode=mode)
            yield (mode.name, "one_stage", 0, k), res, nugget_rank(res, gold)


def _row(qi: int, dataset: str, q: Any, key: tuple[Any, ...], result: Any, rank: Any) -> dict:
    """One row of ``retrieval_per_question.parquet``."""
    docs = list(dict.fromkeys(e.doc_id for e in result.evidence))
    gold = q.doc_ids or []
    return {
        "qid": qi,
        "dataset": dataset,
        **dict(zip(("retrieval", "evidence", "kc", "k"), key, strict=True)),
        "question": q.question,
        "gold_doc_ids": gold,
        "evidence_doc_ids": docs,
        "evidence_citations": [e.place.citation(e.doc_id) for e in result.evidence],
        "hit": float(any(d in set(gold) for d in docs)),
        "recall": doc_recall(docs, gold),
        "rank": rank,
        "search_ms": result.embed_ms + result.search_ms + result.rerank_ms,
    }


def retrieval_text(results: pa.Table) -> str:
    """A plain-text view of ``retrieval.parquet``: per dataset and evidence kind, one line per
    (kc, k) with each search mode's hit % side by side, then MRR and search mean / P99 ms."""
    rows = results.to_pylist()
    modes = list(dict.fromkeys(r["retrieval"] for r in rows))
    by_key = {(r["dataset"], r["evidence"], r["kc"], r["k"], r["retrieval"]): r for r in rows}
    lines: list[str] = []
    blocks = dict.fromkeys((r["dataset"], r["evidence"]) for r in rows)
    for dataset, kind in blocks:
        n = next(r["n"] for r in rows if (r["dataset"], r["evidence"]) == (dataset, kind))
        lines.append(f"{dataset}: {kind} (n {n}), hit % / MRR / search ms mean, p99")
        head = f"{'kc':>3} {'k':>3}" + "".join(f" {m:>26}" for m in modes)
        lines.append(head)
        configs = dict.fromkeys(
            (r["kc"], r["k"]) for r in rows if (r["dataset"], r["evidence"]) == (dataset, kind)
        )
        for kc, k in configs:
            cells = []
            for m in modes:
                r = by_key.get((dataset, kind, kc, k, m))
                cells.append(
                    " " * 27
                    if r is None
                    else f" {100 * r['hit']:>6.1f} {r['mrr']:>5.3f} "
                    f"{r['search_mean_ms']:>6.1f} {r['search_p99_ms']:>6.1f}"
                )
            lines.append(f"{kc:>3} {k:>3}" + "".join(cells))
        lines.append("")
    return "\n".join(lines).rstrip()
