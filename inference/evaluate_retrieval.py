"""Retrieval-only evaluation: recall of gold documents without the generation model or KV.

For stores built without KV (``kv = false``: a corpus too large for the disk, or one whose KV is
not built yet) and for sweeping ``kc`` / ``k`` cheaply. Per question with gold ``doc_ids``:

- ``chunks``: the documents of the top-``kc`` chunks (TurboRAG's and standard RAG's evidence);
- ``two_stage``: the documents of the top-``k`` nuggets inside those chunks (CoinRAG's evidence);
- ``one_stage``: the documents of the top-``k`` nuggets over the whole nugget table (ablation).

``recall`` is the fraction of the question's gold documents among those documents (hit@kc with
one gold document), the same measure as :func:`inference.evaluate.doc_recall`. ``rank`` is the
1-based rank of the first retrieved item of a gold document (null when none is there): among
the top ``kc`` chunks for ``chunks``, among the retrieved nuggets by score (best first) for the
nugget modes; ``mrr`` is the mean of ``1 / rank`` (0 for none): MRR@kc for chunks, MRR@k for
nuggets. ``search_ms`` is query embedding + index search.

Outputs under ``out_dir``: ``retrieval.parquet`` (one row per mode and (kc, k): ``mode``, ``kc``,
``k``, ``recall``, ``mrr``, ``search_mean_ms``, ``search_p99_ms``, ``n``) and
``retrieval_per_question.parquet``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coinrag.inference.evaluate import doc_recall, p99
from coinrag.schemas.qa import load_questions

MODES = ("chunks", "two_stage", "one_stage")

RETRIEVAL_SCHEMA = pa.schema(
    [
        ("mode", pa.string()),
        ("kc", pa.int32()),  # 0: not applicable (one_stage)
        ("k", pa.int32()),  # 0: not applicable (chunks)
        ("recall", pa.float64()),
        ("mrr", pa.float64()),  # mean reciprocal rank of the first gold chunk / nugget
        ("search_mean_ms", pa.float64()),
        ("search_p99_ms", pa.float64()),
        ("n", pa.int32()),
    ]
)

PER_QUESTION_SCHEMA = pa.schema(
    [
        ("qid", pa.int32()),
        ("mode", pa.string()),
        ("kc", pa.int32()),
        ("k", pa.int32()),
        ("question", pa.string()),
        ("gold_doc_ids", pa.list_(pa.string())),
        ("evidence_doc_ids", pa.list_(pa.string())),
        ("recall", pa.float64()),
        ("rank", pa.int32()),
        ("search_ms", pa.float64()),
    ]
)


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
    """Per-question rows -> one row per (mode, kc, k)."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["kc"], r["k"]), []).append(r)
    out = []
    for (mode, kc, k), rs in groups.items():
        ms = [r["search_ms"] for r in rs]
        out.append(
            {
                "mode": mode,
                "kc": kc,
                "k": k,
                "recall": float(np.mean([r["recall"] for r in rs])),
                "mrr": float(np.mean([1.0 / r["rank"] if r["rank"] else 0.0 for r in rs])),
                "search_mean_ms": float(np.mean(ms)),
                "search_p99_ms": p99(ms),
                "n": len(rs),
            }
        )
    return pa.Table.from_pylist(out, schema=RETRIEVAL_SCHEMA)


def evaluate_retrieval(
    store_path: str | Path,
    questions_path: str | Path,
    out_dir: str | Path,
    kcs: Sequence[int] = (1, 2, 4, 8),
    ks: Sequence[int] = (10,),
    modes: Sequence[str] = MODES,
    *,
    embedder: str | None = None,
    limit: int | None = None,
) -> pa.Table:
    """Recall of gold documents for each mode and (kc, k); write the outputs; return the table.

    Only questions with gold ``doc_ids`` count (a file without any raises ``ValueError``). On an
    index without nuggets (extractor ``none``) only the ``chunks`` mode runs.
    ``embedder`` defaults to the store's; a different one than the index's is refused.
    """
    from coinrag.inference.embedders import load_embedder
    from coinrag.inference.retrieve import Retriever
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.store import Store

    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be among {', '.join(MODES)}; got {list(modes)}")
    if not kcs or not ks or min(kcs) < 1 or min(ks) < 1:
        raise ValueError("kc and k values must be >= 1")
    questions = [q for q in load_questions(questions_path) if q.doc_ids]
    if limit is not None:
        questions = questions[:limit]
    if not questions:
        raise ValueError(f"{questions_path}: no question has gold doc_ids")
    store = Store.at(store_path)
    if not store.exists():
        raise FileNotFoundError(f"{store} is not a coinrag store (run coinrag build first)")
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    retriever = Retriever(store, load_embedder(embedder or settings.embedder))
    if retriever.index.count("nuggets") == 0:  # e.g. built with extractor "none"
        modes = [m for m in modes if m == "chunks"]
        if not modes:
            raise ValueError(f"{store}: the index holds no nuggets; use the chunks mode")
    retriever.chunks_only(questions[0].question, kc=1)  # warm-up: lazy loads, untimed

    rows: list[dict[str, Any]] = []

    def row(qi: int, q: Any, mode: str, kc: int, k: int, result: Any, rank: int | None) -> None:
        docs = list(dict.fromkeys(e.doc_id for e in result.evidence))
        rows.append(
            {
                "qid": qi,
                "mode": mode,
                "kc": kc,
                "k": k,
                "question": q.question,
                "gold_doc_ids": q.doc_ids,
                "evidence_doc_ids": docs,
                "recall": doc_recall(docs, q.doc_ids),
                "rank": rank,
                "search_ms": result.embed_ms + result.search_ms,
            }
        )

    for qi, q in enumerate(questions):
        if "chunks" in modes:
            for kc in sorted(set(kcs)):
                res = retriever.chunks_only(q.question, kc=kc)
                rank = first_gold_rank([h.doc_id for h in res.chunks], q.doc_ids or [])
                row(qi, q, "chunks", kc, 0, res, rank)
        for k in sorted(set(ks)):
            if "two_stage" in modes:
                for kc in sorted(set(kcs)):
                    res = retriever.two_stage(q.question, kc=kc, k=k)
                    row(qi, q, "two_stage", kc, k, res, nugget_rank(res, q.doc_ids or []))
            if "one_stage" in modes:
                res = retriever.one_stage(q.question, k=k)
                row(qi, q, "one_stage", 0, k, res, nugget_rank(res, q.doc_ids or []))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = aggregate_retrieval(rows)
    pq.write_table(
        pa.Table.from_pylist(rows, schema=PER_QUESTION_SCHEMA),
        out / "retrieval_per_question.parquet",
    )
    pq.write_table(results, out / "retrieval.parquet")
    return results


def retrieval_text(results: pa.Table) -> str:
    """A plain-text table of ``retrieval.parquet`` (recall in percent)."""
    lines = [f"{'mode':<10} {'kc':>3} {'k':>3} {'recall%':>8} {'mrr':>6} {'ms mean':>8} {'p99':>8}"]
    for r in results.to_pylist():
        mrr = "" if r["mrr"] is None else f"{r['mrr']:.3f}"
        lines.append(
            f"{r['mode']:<10} {r['kc']:>3} {r['k']:>3} {100 * r['recall']:>8.1f} {mrr:>6} "
            f"{r['search_mean_ms']:>8.1f} {r['search_p99_ms']:>8.1f}"
        )
    return "\n".join(lines)
