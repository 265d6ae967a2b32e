"""Retrieval over the store's index: CoinRAG's two-stage nugget search, its one-stage ablation,
and whole-chunk retrieval for TurboRAG / standard RAG.

Every method returns :class:`Evidence` triples ``(chunk_id, tok_start, tok_end)`` (plus what is
needed to fetch and show them) in the order the prefix is assembled in. The paper keeps the
selected nuggets "in retrieval order and in-document order"; precisely:

- :meth:`Retriever.two_stage`: stage 1 ranks chunks (top-``kc`` over ``chunks``); stage 2 ranks
  the nuggets of those chunks only (top-``k`` over ``nuggets`` prefiltered to ``chunk_id IN
  stage-1``). The selected nuggets are grouped by chunk; the groups follow the **stage-1 chunk
  rank** (best chunk first; chunks without a selected nugget are dropped) and the nuggets inside a
  group follow **document order** (``tok_start``, then ``tok_end``). So nuggets of one passage stay
  together and read as they do in the passage, and the passages come in retrieval order.
- :meth:`Retriever.one_stage` (the ablation): top-``k`` over all nuggets; there is no chunk
  ranking, so the groups follow the rank of **each chunk's best selected nugget**, with document
  order inside a group, as above.
- :meth:`Retriever.chunks_only`: top-``kc`` chunks, best first, each as one evidence spanning the
  whole chunk (``tok_start=0``, ``tok_end=n_tokens``).

A retriever with a :class:`~inference.retrieval.rerank.Reranker` ranks chunks in two steps: the
search's top ``max(kc, depth)``, reordered by the reranker, of which the first ``kc`` are kept
(stage 1 of :meth:`Retriever.two_stage` and :meth:`Retriever.chunks_only` alike).

``Evidence.score`` is the cosine similarity of that evidence (a nugget's own score, or the
chunk's). Nuggets of one chunk may overlap (adjacent nuggets share a few tokens); they are
returned as selected, and the assembler decides whether to merge overlapping spans.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from coinrag.inference.retrieval.embedders import Embedder
from coinrag.inference.retrieval.normalise import DistributionBased, ScoreNormaliser
from coinrag.inference.retrieval.rerank import Reranker
from coinrag.schemas.registry import Registered, Registry
from coinrag.schemas.settings import DEFAULT_QUERY, DEFAULT_RETRIEVAL, RETRIEVAL_MODES
from coinrag.schemas.tables import PlaceInDocument
from coinrag.storage.index.lance import ID_COLUMNS, LanceIndex, in_filter
from coinrag.storage.store import Store


@dataclass(frozen=True)
class ScoreParts:
    """How a hybrid hit's score was made: its 1-based rank and own score in the dense ranking
    (cosine similarity) and in the lexical one (BM25), None where it was not among that
    ranking's top rows, and the dense weight; ``score = dense_weight * dense_norm + (1 -
    dense_weight) * lexical_norm``, each ``_norm`` the score normalised over its ranking's top
    rows by :data:`FUSION_NORMALISER` (0 to about 1.4 at 30 rows; 0 where it was not
    ranked)."""

    dense_rank: int | None
    dense_score: float | None
    dense_norm: float
    lexical_rank: int | None
    lexical_score: float | None
    lexical_norm: float
    dense_weight: float


@dataclass(frozen=True)
class Evidence:
    """One retrieved span: tokens ``[tok_start, tok_end)`` of chunk ``chunk_id``; ``parts``:
    how a hybrid search scored it (None for one search alone)."""

    chunk_id: str
    doc_id: str
    content_key: str  # the chunk's content key: where its KV lives
    tok_start: int
    tok_end: int
    text: str
    score: float
    place: PlaceInDocument = PlaceInDocument()  # its file, pages and section
    parts: ScoreParts | None = None


@dataclass(frozen=True)
class ChunkHit:
    """A stage-1 chunk, with its rank (0 = best) and score."""

    chunk_id: str
    doc_id: str
    content_key: str
    n_tokens: int
    text: str
    score: float
    rank: int
    place: PlaceInDocument = PlaceInDocument()
    parts: ScoreParts | None = None


@dataclass
class RetrievalResult:
    method: str  # two_stage | one_stage | chunks_only
    evidence: list[Evidence]
    chunks: list[ChunkHit] = field(default_factory=list)  # stage 1 (two_stage, chunks_only)
    embed_ms: float = 0.0  # embedding the question (0 for a lexical search)
    search_ms: float = 0.0  # all index searches and their fusion
    mode: str = DEFAULT_RETRIEVAL  # the search mode (schemas.settings.RETRIEVAL_MODES)
    rerank_ms: float = 0.0  # the reranker's scoring (0 without one)

    @property
    def triples(self) -> list[tuple[str, int, int]]:
        """``(chunk_id, tok_start, tok_end)`` in assembly order."""
        return [(e.chunk_id, e.tok_start, e.tok_end) for e in self.evidence]

    @property
    def active_tokens(self) -> int:
        return sum(e.tok_end - e.tok_start for e in self.evidence)


HYBRID_DEPTH = 30  # rows each ranking of a hybrid search contributes (at least k)
HYBRID_DENSE_WEIGHT = 0.5  # the dense ranking's weight in relative score fusion where the index
# records none for FUSION_METHOD and has no nuggets (``coinrag train fusion`` chooses one per
# index: :func:`dense_weight`)
HYBRID_DENSE_WEIGHT_WITH_NUGGETS = 0.65  # the same where the index has nuggets: dense search
# then scores a chunk by its best window and its best nugget (DenseSearch.combine), the stronger
# ranking (docs/retrieval.md, "Where there are nuggets")
FUSION_NORMALISER: ScoreNormaliser = DistributionBased()  # how each ranking's scores are scaled
FUSION_METHOD = f"{FUSION_NORMALISER.name}-convex-v1"  # what a recorded dense weight was chosen for
NUGGET_FANOUT = 5  # dense chunk search: nuggets searched per chunk wanted
DOCUMENT_CHUNK_FANOUT = 4  # lexical document ranking: chunks searched per document wanted


def relative_scores(
    rankings: Sequence[Sequence[tuple[Hashable, float]]],
    weights: Sequence[float],
    normaliser: ScoreNormaliser = FUSION_NORMALISER,
) -> dict[Hashable, float]:
    """Relative score fusion: each ranking's ``(item, score)`` rows (its top rows, any scale)
    normalised by ``normaliser`` (``inference/retrieval/normalise.py``; default
    :data:`FUSION_NORMALISER`, distribution-based), and every item scoring the sum of ``weight *
    normalised`` over the rankings it is in (0 in one it is not in). Dict order is first
    appearance (a stable tie-break).

    >>> from coinrag.inference.retrieval.normalise import MinMax
    >>> relative_scores([[("a", 0.9), ("b", 0.5), ("c", 0.1)], [("c", 12.0), ("a", 4.0)]],
    ...                 [0.75, 0.25], MinMax())
    {'a': 0.75, 'b': 0.375, 'c': 0.25}
    """
    fused: dict[Hashable, float] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        if not ranking:
            continue
        norms = normaliser.normalise([float(score) for _, score in ranking])
        for (item, _), norm in zip(ranking, norms, strict=True):
            fused[item] = fused.get(item, 0.0) + weight * norm
    return fused


def default_dense_weight(index: LanceIndex) -> float:
    """The dense weight of an ``index`` none was chosen for:
    :data:`HYBRID_DENSE_WEIGHT_WITH_NUGGETS` where it has nuggets (its dense ranking is another
    scorer then), else :data:`HYBRID_DENSE_WEIGHT`."""
    return HYBRID_DENSE_WEIGHT_WITH_NUGGETS if index.count("nuggets") else HYBRID_DENSE_WEIGHT


def dense_weight(index: LanceIndex) -> float:
    """The dense ranking's weight in hybrid fusion for ``index``: the one chosen for it on
    synthetic questions of its store and recorded with the index version (``IndexMeta.fusion``,
    ``tasks/retrieval/fusion.py``) when it was chosen for this code's :data:`FUSION_METHOD`, else
    :func:`default_dense_weight` (a weight chosen for another normalisation, e.g. the min-max
    one of earlier versions, means something else; a record whose choice the held-out questions
    did not confirm, ``confirmed_on_held_out = false``, kept the default of its day, so the
    code's default applies); lexical weighs the rest."""
    fusion = index.meta.fusion or {}
    chosen = fusion.get("method") == FUSION_METHOD and "dense_weight" in fusion
    if not chosen or fusion.get("confirmed_on_held_out") is False:
        return default_dense_weight(index)
    return float(fusion["dense_weight"])


def fuse_rankings(
    lists: Sequence[Sequence[dict[str, Any]]], key: str, k: int, weight: float
) -> list[dict[str, Any]]:
    """The top ``k`` rows of the dense and lexical ``lists`` (rows with ``key`` and ``score``,
    in that order) by :func:`relative_scores` with weights ``(weight, 1 - weight)``; each row
    as first seen, its ``score`` the fused one."""
    rows: dict[Hashable, dict[str, Any]] = {}
    for ranking in lists:
        for row in ranking:
            rows.setdefault(row[key], row)
    rankings = [[(row[key], row["score"]) for row in ranking] for ranking in lists]
    scores = relative_scores(rankings, [weight, 1.0 - weight])
    order = sorted(scores, key=lambda item: -scores[item])[:k]
    seen = [_ranked(ranking) for ranking in rankings]
    return [
        {**rows[item], "score": scores[item], "score_parts": _parts(item, seen, weight)}
        for item in order
    ]


def _ranked(ranking: Sequence[tuple[Hashable, float]]) -> dict[Hashable, tuple[int, float, float]]:
    """``{item: (1-based rank, score, normalised score)}`` of one ranking."""
    norms = relative_scores([ranking], [1.0])
    out: dict[Hashable, tuple[int, float, float]] = {}
    for i, (item, score) in enumerate(ranking):
        out.setdefault(item, (i + 1, float(score), norms[item]))
    return out


def _parts(
    item: Hashable, seen: Sequence[dict[Hashable, tuple[int, float, float]]], weight: float
) -> ScoreParts:
    """``item``'s :class:`ScoreParts` from the dense and lexical rankings (``_ranked``)."""
    (d_rank, d_score, d_norm), (l_rank, l_score, l_norm) = (
        ranked.get(item, (None, None, 0.0)) for ranked in seen
    )
    return ScoreParts(d_rank, d_score, d_norm, l_rank, l_score, l_norm, weight)


def order_nuggets(nuggets: list[dict[str, Any]], chunk_rank: dict[str, int]) -> list[Evidence]:
    """Group nuggets by chunk, groups by ``chunk_rank`` (lower first), document order inside.

    A chunk missing from ``chunk_rank`` ranks after all listed ones, by its best nugget.
    """
    best: dict[str, int] = {}
    for i, n in enumerate(sorted(nuggets, key=lambda r: -r["score"])):
        best.setdefault(n["chunk_id"], i)

    def key(n: dict[str, Any]) -> tuple[int, int, int, int]:
        cid = n["chunk_id"]
        group = chunk_rank.get(cid, len(chunk_rank) + best[cid])
        return (group, best[cid], int(n["tok_start"]), int(n["tok_end"]))

    return [
        Evidence(**_hit(n), tok_start=int(n["tok_start"]), tok_end=int(n["tok_end"]))
        for n in sorted(nuggets, key=key)
    ]


def _hit(row: dict[str, Any]) -> dict[str, Any]:
    """What every hit (:class:`Evidence`, :class:`ChunkHit`) takes from its search row: the
    chunk, its document and content key, the text, the score and the place."""
    named = {name: row[name] for name in ("chunk_id", "doc_id", "content_key", "text")}
    place = PlaceInDocument.from_mapping(row)
    return {**named, "score": float(row["score"]), "place": place, "parts": row.get("score_parts")}


class Query:
    """A question as the searches need it: its text (lexical search) and its vector (dense
    search), embedded on first use and once only; ``embed_ms`` is the time that took."""

    def __init__(self, text: str, embedder: Embedder) -> None:
        self.text = text
        self.embedder = embedder
        self._vector: np.ndarray | None = None
        self.embed_ms = 0.0
        self.rerank_ms = 0.0  # time a reranker spent on it

    @property
    def vector(self) -> np.ndarray:
        """The query's ``(dim,)`` float32 vector (with the embedder's query instruction)."""
        if self._vector is None:
            t = time.perf_counter()
            self._vector = self.embedder.embed_queries([self.text])[0]
            self.embed_ms += (time.perf_counter() - t) * 1000.0
        return self._vector


class SearchMode(Registered, ABC):
    """How a table of the index is ranked for a query: one subclass per ``retrieval`` setting
    (``schemas.settings.RETRIEVAL_MODES``), registered by its ``name`` in :data:`SEARCH_MODES`
    (``SearchMode.registry``, the plug-in registry of ``schemas/registry.py``).

    :meth:`rank` returns the top-``k`` rows of ``chunks`` or ``nuggets`` (their
    ``storage.index.lance.HIT_COLUMNS`` and a ``score``: higher is better, on the mode's own scale),
    best first; ``where`` is a prefilter (``chunk_id IN (...)``, ``doc_id IN (...)``), under
    which the search is exact. :meth:`documents` ranks whole documents (cartridge selection).
    """

    registry: ClassVar[Registry[SearchMode]] = Registry("retrieval mode", RETRIEVAL_MODES)

    @abstractmethod
    def rank(
        self, index: LanceIndex, table: str, query: Query, k: int, where: str | None = None
    ) -> list[dict[str, Any]]: ...

    @abstractmethod
    def documents(self, index: LanceIndex, query: Query, k: int) -> list[dict[str, Any]]: ...


SEARCH_MODES = SearchMode.registry  # name -> SearchMode subclass


def search_mode(mode: str | SearchMode | None) -> SearchMode:
    """The search mode named ``mode`` (None: the default, :data:`DEFAULT_RETRIEVAL`)."""
    if isinstance(mode, SearchMode):
        return mode
    name = DEFAULT_RETRIEVAL if mode is None else mode
    if name not in SEARCH_MODES:
        raise ValueError(f"retrieval {name!r} is not one of {', '.join(SEARCH_MODES.known())}")
    return SEARCH_MODES[name]()


class DenseSearch(SearchMode, name="dense"):
    """Cosine similarity of the query's vector and the rows' vectors (ANN above the index's
    threshold, exact under a prefilter); ``score`` is the cosine similarity.

    A chunk's own cosine is the best of its windows' (the ``windows`` table: pieces the
    embedder sees whole that cover the chunk end to end, ``tasks.embed``), so a chunk whose
    answer sits past the embedder's ``max_length`` (MiniLM: 256 word pieces, about a third of a
    512-token chunk) is still found; an index written before windows existed has the chunk's
    own vector (its first ``max_length`` word pieces) instead. Where there are nuggets, a chunk
    scores the mean of its own cosine and its best nugget's (:meth:`combine`, :meth:`_chunks`):
    measured on the Python documentation (``tests/benchmarks/bench_chunk_coverage.py``,
    docs/retrieval.md), the mean beats either alone at kc 1 on natural questions (79.4 against
    71.4 and 66.7 %) and stays within a question of the best nugget on questions that repeat a
    section title."""

    @staticmethod
    def combine(own: float, best_nugget: float) -> float:
        """A chunk's score from its own cosine and its best nugget's: their mean."""
        return (own + best_nugget) / 2.0

    def _search(
        self,
        index: LanceIndex,
        table: str,
        query: Query,
        k: int,
        where: str | None,
        coarse: bool = False,
    ) -> list[dict[str, Any]]:
        fp = query.embedder.fingerprint
        vector = query.vector
        return index.search_vector(table, vector, k, embedder_fp=fp, where=where, coarse=coarse)

    def _own(self, index: LanceIndex, query: Query, k: int, where: str | None) -> dict[str, float]:
        """Chunk id -> own cosine (exact) of the top ``k`` chunks (fewer if there are not that
        many), best first: by their best window (in one pass where the reader holds the windows
        in memory, else the chunks of the top windows, more windows asked while they hold fewer
        than ``k`` chunks), or by their own vector."""
        if not index.count("windows"):
            rows = self._search(index, "chunks", query, k, where)
            return {row["chunk_id"]: float(row["score"]) for row in rows}
        fp = query.embedder.fingerprint
        grouped = index.best_of_groups(
            "windows", "chunk_id", query.vector, k, embedder_fp=fp, where=where
        )
        if grouped is not None:
            return dict(grouped)
        wide = k
        while True:
            rows = self._search(index, "windows", query, wide, where)
            best: dict[str, float] = {}
            for row in rows:  # best first: a chunk's first window is its best
                best.setdefault(row["chunk_id"], float(row["score"]))
            if len(best) >= k or len(rows) < wide:
                return dict(list(best.items())[:k])
            wide *= 2

    def _own_of(self, index: LanceIndex, query: Query, chunk_ids: list[str]) -> dict[str, float]:
        """Chunk id -> own cosine (exact) of these chunks, read by id."""
        table = "windows" if index.count("windows") else "chunks"
        rows = index.rows_where(table, in_filter("chunk_id", chunk_ids), None, extra=("vector",))
        best: dict[str, float] = {}
        for row in rows:
            cos = float(np.dot(np.asarray(row["vector"], np.float32), query.vector))
            best[row["chunk_id"]] = max(best.get(row["chunk_id"], -2.0), cos)
        return best

    def _chunks(
        self, index: LanceIndex, query: Query, k: int, where: str | None
    ) -> list[dict[str, Any]]:
        """Top-``k`` chunks by own cosine (:meth:`_own`), or where there are nuggets by
        :meth:`combine` of it and the best nugget's, over the candidates: the top ``NUGGET_FANOUT
        * k`` chunks by own cosine, and the chunks of the top ``NUGGET_FANOUT * k`` nuggets (both
        under the same prefilter). A candidate's own cosine is exact (read by id for a chunk found
        through a nugget); its best nugget is its best among those nuggets, else its own cosine
        stands in (a chunk none of whose nuggets made the cut)."""
        wide = NUGGET_FANOUT * k
        nuggets = index.count("nuggets") > 0
        own = self._own(index, query, wide if nuggets else k, where)
        scores = dict(own)
        if nuggets:
            best: dict[str, float] = {}
            for row in self._search(index, "nuggets", query, wide, where, coarse=True):
                best[row["chunk_id"]] = max(best.get(row["chunk_id"], -2.0), row["score"])
            missing = [cid for cid in best if cid not in own]
            if missing:
                own.update(self._own_of(index, query, missing))
            scores = {cid: self.combine(s, best.get(cid, s)) for cid, s in own.items()}
        top = sorted(scores, key=lambda cid: -scores[cid])[:k]
        found = index.rows_where("chunks", in_filter("chunk_id", top), len(top))
        rows = {row["chunk_id"]: row for row in found}
        return [{**rows[cid], "score": scores[cid]} for cid in top if cid in rows]

    def rank(
        self, index: LanceIndex, table: str, query: Query, k: int, where: str | None = None
    ) -> list[dict[str, Any]]:
        if table == "chunks":
            return self._chunks(index, query, k, where)
        return self._search(index, table, query, k, where)

    def documents(self, index: LanceIndex, query: Query, k: int) -> list[dict[str, Any]]:
        return index.search_documents(query.vector, k, embedder_fp=query.embedder.fingerprint)


class LexicalSearch(SearchMode, name="lexical"):
    """BM25 of the question's words against the rows' text (LanceDB's full-text index over the
    whole text, never truncated); ``score`` is the BM25 score. A document ranks by its best
    chunk."""

    def rank(
        self, index: LanceIndex, table: str, query: Query, k: int, where: str | None = None
    ) -> list[dict[str, Any]]:
        return index.search_text(table, query.text, k, where=where)

    def documents(self, index: LanceIndex, query: Query, k: int) -> list[dict[str, Any]]:
        chunks = self.rank(index, "chunks", query, k * DOCUMENT_CHUNK_FANOUT)
        best: dict[str, dict[str, Any]] = {}
        for row in chunks:
            best.setdefault(
                row["doc_id"],
                {"doc_id": row["doc_id"], "doc_version": row["doc_version"], "score": row["score"]},
            )
        return list(best.values())[:k]


class HybridSearch(SearchMode, name="hybrid"):
    """Dense (:class:`DenseSearch`) and lexical rankings fused by their scores
    (:func:`relative_scores`): each ranks its top ``max(k, HYBRID_DEPTH)`` rows, each ranking's
    scores are normalised by :data:`FUSION_NORMALISER` (distribution-based: how far a row stands
    out of its own ranking, ``inference/retrieval/normalise.py``), and a row scores the index's
    dense weight (:func:`dense_weight`: chosen per store on its synthetic questions, recorded
    with the index version; default :func:`default_dense_weight`: equal weights, 0.65 with
    nuggets) times its dense one plus the rest times its lexical one; the fused top ``k`` are
    kept (``score``: the fused score, 0 to about 1.4). The same weight ranks chunks, nuggets
    (both stages of two-stage retrieval) and documents.

    Measured on the Python docs (docs/retrieval.md, ``bench_fusion.py``): equal-weight
    reciprocal rank fusion fell 6 points below dense at kc 1 (a rank in the weaker list counts
    as much as one in the stronger); min-max normalised scores (dense 0.75, the rule before)
    gave every ranking's top row 1, so a page that only BM25 found, however far ahead of BM25's
    other rows, scored at most 0.25 and fell behind dense's eighth row; distribution-based
    normalisation at equal weights lets the standout of either ranking win: on 176 FAQ
    questions hybrid hit@1/4 84.1/96.0 on the reST text and 86.9/96.6 on the HTML pages, against
    77.3/93.2 and 79.0/92.0 with min-max at 0.75.

    The lexical search needs no query vector: where LanceDB answers it (~5 ms), it runs on a
    second thread while this one embeds the question and searches by vector (LanceDB's
    searches and torch release the GIL), so its time hides behind the embedding's; where a
    reader's in-memory BM25 copy answers it (under a millisecond, holding the GIL), it runs on
    this thread after the dense half (faster: 12.5 against 14.2 ms a two-stage retrieval on the
    9 FAQ pages, one thread). The two rankings are fused in a fixed order (dense, lexical), so
    the result does not depend on which finished first."""

    dense: ClassVar[SearchMode] = DenseSearch()
    lexical: ClassVar[SearchMode] = LexicalSearch()

    def lists(
        self, index: LanceIndex, table: str, query: Query, depth: int, where: str | None = None
    ) -> list[list[dict[str, Any]]]:
        """The dense and lexical rankings (top ``depth`` each) that :meth:`rank` fuses."""
        if index.searches_text_in_memory(table):
            return [
                self.dense.rank(index, table, query, depth, where),
                self.lexical.rank(index, table, query, depth, where),
            ]
        words = _lexical_pool().submit(self.lexical.rank, index, table, query, depth, where)
        return [self.dense.rank(index, table, query, depth, where), words.result()]

    def rank(
        self, index: LanceIndex, table: str, query: Query, k: int, where: str | None = None
    ) -> list[dict[str, Any]]:
        lists = self.lists(index, table, query, max(k, HYBRID_DEPTH), where)
        return fuse_rankings(lists, ID_COLUMNS[table], k, dense_weight(index))

    def documents(self, index: LanceIndex, query: Query, k: int) -> list[dict[str, Any]]:
        depth = max(k, HYBRID_DEPTH)
        if index.searches_text_in_memory("chunks"):  # documents are searched by their chunks
            lists = [
                self.dense.documents(index, query, depth),
                self.lexical.documents(index, query, depth),
            ]
        else:
            words = _lexical_pool().submit(self.lexical.documents, index, query, depth)
            lists = [self.dense.documents(index, query, depth), words.result()]
        return fuse_rankings(lists, "doc_id", k, dense_weight(index))


@functools.cache
def _lexical_pool() -> ThreadPoolExecutor:
    """The one thread hybrid searches run their lexical half on (made on first use)."""
    return ThreadPoolExecutor(1, thread_name_prefix="coinrag-lexical")


class Retriever:
    """Searches one store's index with one embedder (refused if it is not the index's), in a
    search mode (``mode``: the default of every call; each call may name another); chunks
    reordered by ``reranker`` (None: the search's order; as it reorders this index's searches,
    ``Reranker.for_index``)."""

    def __init__(
        self,
        store: Store,
        embedder: Embedder,
        index: LanceIndex | None = None,
        mode: str | None = None,
        reranker: Reranker | None = None,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.index = index or LanceIndex.open(store)
        self.index.check(embedder.fingerprint)
        self.mode = search_mode(mode)
        self.reranker = None if reranker is None else reranker.for_index(self.index)

    def _start(self, question: str, mode: str | SearchMode | None) -> tuple[SearchMode, Query]:
        return (self.mode if mode is None else search_mode(mode)), Query(question, self.embedder)

    def _chunks(
        self, search: SearchMode, query: Query, kc: int, doc_ids: Sequence[str] | None = None
    ) -> list[ChunkHit]:
        where = None if doc_ids is None else in_filter("doc_id", doc_ids)
        depth = kc if self.reranker is None else max(kc, self.reranker.depth)
        rows = search.rank(self.index, "chunks", query, depth, where)
        hits = [
            ChunkHit(**_hit(r), n_tokens=int(r["n_tokens"]), rank=i) for i, r in enumerate(rows)
        ]
        if self.reranker is not None:
            t = time.perf_counter()
            hits = self.reranker.rerank(query.text, hits)
            query.rerank_ms += (time.perf_counter() - t) * 1000.0
        return hits[:kc]

    @staticmethod
    def _timed(
        kind: str,
        search: SearchMode,
        query: Query,
        started: float,
        evidence: list[Evidence],
        hits: list[ChunkHit],
    ) -> RetrievalResult:
        total = (time.perf_counter() - started) * 1000.0
        search_ms = total - query.embed_ms - query.rerank_ms
        return RetrievalResult(
            kind, evidence, hits, query.embed_ms, search_ms, search.name, query.rerank_ms
        )

    def two_stage(
        self,
        question: str,
        kc: int = DEFAULT_QUERY.kc,
        k: int = DEFAULT_QUERY.k,
        doc_ids: Sequence[str] | None = None,
        mode: str | SearchMode | None = None,
    ) -> RetrievalResult:
        """CoinRAG: top-``kc`` chunks, then the top-``k`` nuggets inside them (see module doc),
        both ranked by ``mode`` (default: this retriever's).

        ``doc_ids``: stage 1 ranks only these documents' chunks (training restricts retrieval
        to an example's own documents)."""
        search, query = self._start(question, mode)
        t = time.perf_counter()
        hits = self._chunks(search, query, kc, doc_ids)
        nuggets: list[dict[str, Any]] = []
        if hits:
            where = in_filter("chunk_id", [h.chunk_id for h in hits])
            nuggets = search.rank(self.index, "nuggets", query, k, where)
        evidence = order_nuggets(nuggets, {h.chunk_id: h.rank for h in hits})
        return self._timed("two_stage", search, query, t, evidence, hits)

    def one_stage(
        self, question: str, k: int = DEFAULT_QUERY.k, mode: str | SearchMode | None = None
    ) -> RetrievalResult:
        """The ablation: top-``k`` nuggets over the whole nugget table (see module doc)."""
        search, query = self._start(question, mode)
        t = time.perf_counter()
        nuggets = search.rank(self.index, "nuggets", query, k)
        return self._timed("one_stage", search, query, t, order_nuggets(nuggets, {}), [])

    def chunks_only(
        self,
        question: str,
        kc: int = DEFAULT_QUERY.kc,
        doc_ids: Sequence[str] | None = None,
        mode: str | SearchMode | None = None,
    ) -> RetrievalResult:
        """Whole chunks, best first (TurboRAG and standard RAG); ``doc_ids``: only these
        documents' chunks."""
        search, query = self._start(question, mode)
        t = time.perf_counter()
        hits = self._chunks(search, query, kc, doc_ids)
        evidence = [
            Evidence(
                h.chunk_id,
                h.doc_id,
                h.content_key,
                0,
                h.n_tokens,
                h.text,
                h.score,
                h.place,
                h.parts,
            )
            for h in hits
        ]
        return self._timed("chunks_only", search, query, t, evidence, hits)

    def documents(
        self, question: str, k: int = 5, mode: str | SearchMode | None = None
    ) -> list[dict[str, Any]]:
        """Top-``k`` documents (cartridge selection), best first: dicts with ``doc_id``,
        ``doc_version`` and ``score``."""
        search, query = self._start(question, mode)
        return search.documents(self.index, query, k)
