"""Whether an adapted embedder finds held-out pages better than its base, judged before the
store's index is re-embedded with it (``coinrag train retriever``'s guard).

Re-embedding the whole index is the longest part of ``train retriever`` (17 minutes for the Python
documentation with nuggets on a 2-core VM), and an adapted embedder can be worse than its base (the
local generator's questions made dense search worse on natural questions). So before re-embedding,
both embedders search a **pool**: every window of up to ``pages`` pages (a seeded sample of the
pages that held-out questions ask about) and of as many other pages again (distractors), all
``fusion`` or ``report`` pages (``tasks.retrieval.fusion.page_split``: never trained on). The
questions are the held-out synthetic questions of those pages: the generator's where ``train
retriever --generated N`` made them, else the headings and nuggets (without any evaluation file's
question), at most :data:`MAX_GUARD_QUESTIONS` of them in that order of kinds. Each question ranks
the pool's chunks by their best window's cosine (the base with the vectors the index holds, the
adapted embedder with the same windows embedded again in the store's ``embed_dtype``); a chunk that
holds the question word for word is left out (``fusion.quotes``: a heading is written in its own
section). The adapted embedder is adopted when its MRR (within 8, the gold page's first chunk) is at
least the base's; where no held-out question exists (a store without headings, nuggets or generated
questions on its held-out pages) nothing can be judged and it is adopted, as without the guard.

Shapes: question vectors ``(Q, dim)``, window vectors ``(W, dim)``, both unit float32;
cosines ``(Q, W)``; ranks over chunks, 1-based.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from coinrag.inference.retrieval.embedders import Embedder
from coinrag.inference.retrieval.fusion import quotes
from coinrag.storage.index.lance import LanceIndex
from coinrag.tasks.retrieval.fusion import SyntheticQuestion, page_split, sample_by_kind

GUARD_KCS = (1, 2, 4, 8)  # hit@kc reported; MRR within the largest
MAX_GUARD_QUESTIONS = 300  # asked at most (generated questions first, then headings, nuggets)


@dataclass(frozen=True)
class Pool:
    """The windows both embedders search: ``chunk_ids`` and ``doc_ids`` ``(W,)`` per window,
    ``texts`` the strings embedded (``search_text``), ``vectors`` ``(W, dim)`` the index's
    (the base embedder's) and ``chunk_texts`` per chunk id (for :func:`quotes`)."""

    chunk_ids: list[str]
    doc_ids: list[str]
    texts: list[str]
    vectors: np.ndarray
    chunk_texts: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class GuardVerdict:
    """Both embedders' hit@kc and MRR (fractions) on the pool, and whether to adopt."""

    adopted: bool
    base: dict[str, float]
    adapted: dict[str, float]
    questions: int
    pages: int
    windows: int
    kind: str  # the questions' kinds joined by "+" ("heading+nugget"); "none": none held out

    def record(self) -> dict[str, Any]:
        return asdict(self)


def held_out_pages(questions: Sequence[SyntheticQuestion], pages: int, seed: int) -> list[str]:
    """Up to ``pages`` of the pages ``questions`` ask about, held out from training (not
    ``retriever`` pages), a sample seeded by ``seed`` in page order."""
    held = sorted({q.doc_id for q in questions if page_split(q.doc_id) != "retriever"})
    return sorted(random.Random(seed).sample(held, min(pages, len(held))))


def read_pool(index: LanceIndex, gold_pages: Sequence[str], seed: int) -> Pool:
    """Every window of ``gold_pages`` and of as many other held-out pages (seeded), from the
    published index, with the chunks' texts."""
    gold = set(gold_pages)
    docs = sorted(set(index.columns("chunks", ["doc_id"]).column("doc_id").to_pylist()))
    others = [d for d in docs if d not in gold and page_split(d) != "retriever"]
    pages = gold | set(random.Random(seed + 1).sample(others, min(len(gold), len(others))))
    rows = [
        r
        for r in index.columns(
            "windows", ["chunk_id", "doc_id", "search_text", "vector", "window_id"]
        ).to_pylist()
        if r["doc_id"] in pages
    ]
    rows.sort(key=lambda r: r["window_id"])
    chunks = {
        r["chunk_id"]: r
        for r in index.columns("chunks", ["chunk_id", "doc_id", "text"]).to_pylist()
        if r["doc_id"] in pages
    }
    vectors = np.asarray([r["vector"] for r in rows], dtype=np.float32).reshape(len(rows), -1)
    return Pool(
        [r["chunk_id"] for r in rows],
        [r["doc_id"] for r in rows],
        [r["search_text"] for r in rows],
        vectors,
        chunks,
    )


def gold_ranks(
    queries: np.ndarray,
    windows: np.ndarray,
    chunk_ids: Sequence[str],
    doc_ids: Sequence[str],
    gold: Sequence[str],
    masked: Sequence[set[str]],
    depth: int = max(GUARD_KCS),
) -> list[int | None]:
    """Per question (``queries`` ``(Q, dim)``): the 1-based rank of the first chunk of its
    ``gold`` page when chunks are ranked by their best window's cosine (``windows`` ``(W,
    dim)``), leaving out the chunks in its ``masked`` set; None past ``depth``.

    >>> w = np.eye(3, dtype=np.float32)
    >>> gold_ranks(w[[1]], w, ["a", "b", "c"], ["A", "B", "C"], ["B"], [set()])
    [1]
    >>> gold_ranks(w[[1]], w, ["a", "b", "c"], ["A", "B", "C"], ["B"], [{"b"}])
    [None]
    """
    cosines = queries @ windows.T  # (Q, W)
    out: list[int | None] = []
    for row, page, skip in zip(cosines, gold, masked, strict=True):
        seen: set[str] = set()
        rank = None
        for i in np.argsort(-row, kind="stable"):
            chunk = chunk_ids[i]
            if chunk in seen or chunk in skip:
                continue
            seen.add(chunk)
            if doc_ids[i] == page:
                rank = len(seen)
                break
            if len(seen) >= depth:
                break
        out.append(rank)
    return out


def rank_scores(ranks: Sequence[int | None]) -> dict[str, float]:
    """``hit@kc`` for :data:`GUARD_KCS` and ``mrr`` (within the largest), fractions.

    >>> rank_scores([1, 3, None])
    {'hit@1': 0.3333, 'hit@2': 0.3333, 'hit@4': 0.6667, 'hit@8': 0.6667, 'mrr': 0.4444}
    """
    n = max(len(ranks), 1)
    out = {
        f"hit@{k}": round(sum(r is not None and r <= k for r in ranks) / n, 4) for k in GUARD_KCS
    }
    out["mrr"] = round(sum(1.0 / r for r in ranks if r is not None) / n, 4)
    return out


def asked_questions(
    questions: Sequence[SyntheticQuestion], pages: Sequence[str], seed: int
) -> list[SyntheticQuestion]:
    """The questions of ``pages``, at most :data:`MAX_GUARD_QUESTIONS`: a seeded sample taken
    kind by kind (``tasks.retrieval.fusion.sample_by_kind``: generated questions and headings
    before nuggets)."""
    on = set(pages)
    return sample_by_kind([q for q in questions if q.doc_id in on], MAX_GUARD_QUESTIONS, seed)


def judge_adapted(
    index: LanceIndex,
    base: Embedder,
    adapted: Embedder,
    questions: Sequence[SyntheticQuestion],
    pages: int,
    seed: int = 0,
) -> GuardVerdict:
    """Compare ``base`` (the index's embedder) and ``adapted`` on held-out ``questions`` of up
    to ``pages`` pages (module docstring); adopted unjudged (``questions == 0``) where none is
    held out."""
    gold_pages = held_out_pages(questions, pages, seed)
    asked = asked_questions(questions, gold_pages, seed)
    if not asked:
        return GuardVerdict(True, {}, {}, 0, 0, 0, "none")
    pool = read_pool(index, gold_pages, seed)
    masked = [{c for c, row in pool.chunk_texts.items() if quotes(row, q.text)} for q in asked]
    texts, gold = [q.text for q in asked], [q.doc_id for q in asked]
    scores = []
    for embedder, windows in (
        (base, pool.vectors),
        (adapted, adapted.embed_documents(pool.texts)),
    ):
        queries = np.asarray(embedder.embed_queries(texts), dtype=np.float32)
        windows = np.asarray(windows, dtype=np.float32)
        ranks = gold_ranks(queries, windows, pool.chunk_ids, pool.doc_ids, gold, masked)
        scores.append(rank_scores(ranks))
    return GuardVerdict(
        adopted=scores[1]["mrr"] >= scores[0]["mrr"],
        base=scores[0],
        adapted=scores[1],
        questions=len(asked),
        pages=len(gold_pages),
        windows=len(pool.texts),
        kind="+".join(sorted({q.kind for q in asked})),
    )
