"""Choosing hybrid search's fusion weight for one index on questions whose answer page is known.

Hybrid search fuses a dense and a lexical ranking of chunks by their normalised scores, ``w * dense
+ (1 - w) * lexical`` (``retriever.relative_scores``, each ranking normalised by
``retriever.FUSION_NORMALISER``; a recorded weight names that method, ``FUSION_METHOD``). Which
``w`` is best depends on the corpus and the embedder (on the Python docs with nuggets dense search
was far stronger than BM25; without nuggets about as strong), so it is chosen per index: each
question's two rankings are computed once (:func:`question_lists`), then every weight of a grid is
scored by the hit rate of the fused top ``kc`` chunks (a hit: a chunk of a gold page among them) at
kc 1, 2, 4, 8 and by the reciprocal rank of the first gold page within 8 (:func:`score_weights`);
the weight with the best mean of those five on the training questions wins (:func:`choose_weight`;
ties go to the weight closest to the code's default). The grid holds 0 (lexical alone) and 1 (dense
alone), so on its training questions the chosen fusion is never below either part.

Worked example: a question whose gold page ``p`` is dense's 2nd and lexical's 1st chunk::

    lists = [[{"chunk_id": "a", "doc_id": "q", "score": 0.9}, {"chunk_id": "b", "doc_id": "p",
              "score": 0.8}, {"chunk_id": "c", "doc_id": "r", "score": 0.1}],
             [{"chunk_id": "b", "doc_id": "p", "score": 9.0}, {"chunk_id": "a", ...: 1.0}]]
    score_weights([QuestionLists(lists, {"p"})], [0.5, 1.0])
    -> {0.5: {"hit@1": 1.0, ...}, 1.0: {"hit@1": 0.0, "hit@2": 1.0, ..., "mrr": 0.5}}
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coinrag.inference.retrieval.rerank import PageSupport
from coinrag.inference.retrieval.retriever import (
    HYBRID_DEPTH,
    ChunkHit,
    HybridSearch,
    Query,
    fuse_rankings,
)
from coinrag.storage.index.lance import LanceIndex

FUSION_KCS = (1, 2, 4, 8)  # the chunk counts a weight is scored at
WEIGHT_GRID = tuple(round(0.05 * i, 2) for i in range(21))  # 0, 0.05, ..., 1
SUPPORT_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)  # page support shares tried


@dataclass(frozen=True)
class QuestionLists:
    """One question's dense and lexical chunk rankings (rows with ``chunk_id``, ``doc_id`` and
    ``score``, best first, ``HYBRID_DEPTH`` each) and the pages that answer it."""

    lists: Sequence[Sequence[dict[str, Any]]]
    gold: frozenset[str]


def normalise(text: str) -> str:
    """Lower-case words only, one space apart: ``"Why is it  so?"`` -> ``"why is it so"``."""
    return " ".join(re.findall(r"\w+", text.lower()))


def quotes(row: dict[str, Any], question: str) -> bool:
    """Whether a chunk row holds ``question``'s words verbatim (in its heading path or text)."""
    words = f" {normalise(question)} "
    return words in f" {normalise(' '.join(row.get('section') or []) + ' ' + row['text'])} "


def question_lists(
    index: LanceIndex, query: Query, gold: Sequence[str], mask_verbatim: bool = True
) -> QuestionLists:
    """The two rankings hybrid search fuses for ``query`` over ``index``'s chunks;
    ``mask_verbatim``: without the chunks that hold the question word for word (:func:`quotes`).

    Why mask: a synthetic question made from the store (a heading) is written in the answer
    chunk, so BM25 finds that chunk by construction; a user's question is not. Masking asks the
    question of the page's other chunks (the rest of its section or page), whose words the
    question does not copy, which is what a user's question is like."""
    lists = HybridSearch().lists(index, "chunks", query, HYBRID_DEPTH)
    if mask_verbatim:
        lists = [[row for row in ranking if not quotes(row, query.text)] for ranking in lists]
    return QuestionLists(lists, frozenset(gold))


def gold_rank(question: QuestionLists, weight: float, depth: int = max(FUSION_KCS)) -> int | None:
    """1-based rank of the first chunk of a gold page in the fused top ``depth`` (None: none)."""
    fused = fuse_rankings(question.lists, "chunk_id", depth, weight)
    for rank, row in enumerate(fused, start=1):
        if row["doc_id"] in question.gold:
            return rank
    return None


def as_hits(rows: Sequence[dict[str, Any]]) -> list[ChunkHit]:
    """Ranked rows (``chunk_id``, ``doc_id``, ``score``, best first) as the ``ChunkHit`` a
    reranker reorders (its page and score; no text)."""
    return [
        ChunkHit(r["chunk_id"], r["doc_id"], "", 0, "", float(r["score"]), i)
        for i, r in enumerate(rows)
    ]


def supported_rank(
    question: QuestionLists, weight: float, support: float, depth: int = max(FUSION_KCS)
) -> int | None:
    """1-based rank of the first chunk of a gold page within ``depth`` once the fused top
    ``HYBRID_DEPTH`` (a hybrid search's rows for ``rerank = support``) are reordered by
    :class:`PageSupport` with share ``support`` (None: none)."""
    hits = as_hits(fuse_rankings(question.lists, "chunk_id", HYBRID_DEPTH, weight))
    for rank, hit in enumerate(PageSupport(support).rerank("", hits)[:depth], start=1):
        if hit.doc_id in question.gold:
            return rank
    return None


def rank_scores(ranks: Sequence[int | None]) -> dict[str, float]:
    """``hit@kc`` for kc in :data:`FUSION_KCS` and ``mrr`` (within 8) of first-gold ranks,
    fractions in [0, 1] (empty: all 0)."""
    n = max(1, len(ranks))
    found = [r for r in ranks if r is not None]
    scores = {f"hit@{kc}": sum(r <= kc for r in found) / n for kc in FUSION_KCS}
    scores["mrr"] = sum(1.0 / r for r in found) / n
    return scores


def score_weights(
    questions: Sequence[QuestionLists], weights: Sequence[float] = WEIGHT_GRID
) -> dict[float, dict[str, float]]:
    """Per weight: :func:`rank_scores` over ``questions`` of the fused ranking."""
    return {float(w): rank_scores([gold_rank(q, w) for q in questions]) for w in weights}


def score_supports(
    questions: Sequence[QuestionLists], weight: float, supports: Sequence[float] = SUPPORT_GRID
) -> dict[float, dict[str, float]]:
    """Per page support share: :func:`rank_scores` over ``questions`` of the ranking fused at
    ``weight`` and reordered by ``rerank = support`` (:func:`supported_rank`)."""
    return {
        float(s): rank_scores([supported_rank(q, weight, s) for q in questions]) for s in supports
    }


def objective(scores: dict[str, float]) -> float:
    """What a weight is chosen by: the mean of its hit@1, 2, 4, 8 and MRR."""
    return sum(scores.values()) / len(scores)


def choose_weight(scored: dict[float, dict[str, float]], default: float) -> float:
    """The weight (or page support share) of the best :func:`objective` (ties: the one closest
    to ``default``)."""
    return max(scored, key=lambda w: (round(objective(scored[w]), 9), -abs(w - default)))


def confirmed_weight(
    chosen: float, default: float, held_out: dict[float, dict[str, float]], n_held_out: int
) -> float:
    """``chosen`` where it beats ``default`` by :func:`objective` on the held-out questions'
    scores (``held_out``: :func:`score_weights` of both), else ``default``: a weight that wins
    only on the questions it was chosen on is noise (on the whole Python documentation with
    nuggets, 0.25 chosen on 194 generated questions scored 0.380 on the 137 held out against
    the default's 0.463). With no held-out question there is nothing to check: ``chosen``."""
    if chosen == default or n_held_out == 0:
        return chosen
    better = round(objective(held_out[chosen]), 9) > round(objective(held_out[default]), 9)
    return chosen if better else default
