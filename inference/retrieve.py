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

``Evidence.score`` is the cosine similarity of that evidence (a nugget's own score, or the
chunk's). Nuggets of one chunk may overlap (adjacent nuggets share a few tokens); they are
returned as selected, and the assembler decides whether to merge overlapping spans.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coinrag.inference.embedders import Embedder
from coinrag.storage.index import LanceIndex
from coinrag.storage.store import Store


@dataclass(frozen=True)
class Evidence:
    """One retrieved span: tokens ``[tok_start, tok_end)`` of chunk ``chunk_id``."""

    chunk_id: str
    doc_id: str
    content_key: str  # the chunk's content key: where its KV lives
    tok_start: int
    tok_end: int
    text: str
    score: float


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


@dataclass
class RetrievalResult:
    method: str  # two_stage | one_stage | chunks_only
    evidence: list[Evidence]
    chunks: list[ChunkHit] = field(default_factory=list)  # stage 1 (two_stage, chunks_only)
    embed_ms: float = 0.0  # embedding the question
    search_ms: float = 0.0  # all index searches

    @property
    def triples(self) -> list[tuple[str, int, int]]:
        """``(chunk_id, tok_start, tok_end)`` in assembly order."""
        return [(e.chunk_id, e.tok_start, e.tok_end) for e in self.evidence]

    @property
    def active_tokens(self) -> int:
        return sum(e.tok_end - e.tok_start for e in self.evidence)


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
        Evidence(
            chunk_id=n["chunk_id"],
            doc_id=n["doc_id"],
            content_key=n["content_key"],
            tok_start=int(n["tok_start"]),
            tok_end=int(n["tok_end"]),
            text=n["text"],
            score=float(n["score"]),
        )
        for n in sorted(nuggets, key=key)
    ]


class Retriever:
    """Searches one store's index with one embedder (refused if it is not the index's)."""

    def __init__(self, store: Store, embedder: Embedder, index: LanceIndex | None = None) -> None:
        self.store = store
        self.embedder = embedder
        self.index = index or LanceIndex.open(store)
        self.index.check(embedder.fingerprint)

    def _embed(self, question: str) -> tuple[np.ndarray, float]:
        t = time.perf_counter()
        vector = self.embedder.embed_queries([question])[0]
        return vector, (time.perf_counter() - t) * 1000.0

    def _chunks(
        self, vector: np.ndarray, kc: int, doc_ids: Sequence[str] | None = None
    ) -> list[ChunkHit]:
        rows = self.index.search_chunks(
            vector, kc, embedder_fp=self.embedder.fingerprint, doc_ids=doc_ids
        )
        return [
            ChunkHit(
                chunk_id=r["chunk_id"],
                doc_id=r["doc_id"],
                content_key=r["content_key"],
                n_tokens=int(r["n_tokens"]),
                text=r["text"],
                score=float(r["score"]),
                rank=i,
            )
            for i, r in enumerate(rows)
        ]

    def two_stage(
        self, question: str, kc: int = 5, k: int = 10, doc_ids: Sequence[str] | None = None
    ) -> RetrievalResult:
        """CoinRAG: top-``kc`` chunks, then the top-``k`` nuggets inside them (see module doc).

        ``doc_ids``: stage 1 ranks only these documents' chunks (training restricts retrieval
        to an example's own documents)."""
        vector, embed_ms = self._embed(question)
        t = time.perf_counter()
        hits = self._chunks(vector, kc, doc_ids)
        nuggets = self.index.search_nuggets(
            vector, k, [h.chunk_id for h in hits], embedder_fp=self.embedder.fingerprint
        )
        search_ms = (time.perf_counter() - t) * 1000.0
        evidence = order_nuggets(nuggets, {h.chunk_id: h.rank for h in hits})
        return RetrievalResult("two_stage", evidence, hits, embed_ms, search_ms)

    def one_stage(self, question: str, k: int = 10) -> RetrievalResult:
        """The ablation: top-``k`` nuggets over the whole nugget table (see module doc)."""
        vector, embed_ms = self._embed(question)
        t = time.perf_counter()
        nuggets = self.index.search_nuggets(vector, k, embedder_fp=self.embedder.fingerprint)
        search_ms = (time.perf_counter() - t) * 1000.0
        return RetrievalResult("one_stage", order_nuggets(nuggets, {}), [], embed_ms, search_ms)

    def chunks_only(
        self, question: str, kc: int = 5, doc_ids: Sequence[str] | None = None
    ) -> RetrievalResult:
        """Whole chunks, best first (TurboRAG and standard RAG); ``doc_ids``: only these
        documents' chunks."""
        vector, embed_ms = self._embed(question)
        t = time.perf_counter()
        hits = self._chunks(vector, kc, doc_ids)
        search_ms = (time.perf_counter() - t) * 1000.0
        evidence = [
            Evidence(h.chunk_id, h.doc_id, h.content_key, 0, h.n_tokens, h.text, h.score)
            for h in hits
        ]
        return RetrievalResult("chunks_only", evidence, hits, embed_ms, search_ms)

    def documents(self, question: str, k: int = 5) -> list[dict[str, Any]]:
        """Top-``k`` documents by their document vector (cartridge selection), best first."""
        vector, _ = self._embed(question)
        return self.index.search_documents(vector, k, embedder_fp=self.embedder.fingerprint)
