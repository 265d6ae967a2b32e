"""How the chunk and nugget methods retrieve: :class:`IndexSearch`, a search of the engine's
:class:`~inference.methods.assets.Index` (``inference.retrieval.retriever.Retriever``), and the
evidence rows their answers carry; each subclass says only which search it runs.

- :class:`TopChunks`: the top-``kc`` chunks, each whole (turborag, standard: one shared result
  per ``kc``);
- :class:`TwoStageNuggets`: the top-``kc`` chunks, then the top-``k`` nuggets inside them
  (coinrag and its isolated / no-alignment ablations);
- :class:`OneStageNuggets`: the top-``k`` nuggets of the whole index (the one-stage ablation).

``doc_ids`` restricts either to those documents' chunks (an oracle's gold documents).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from coinrag.inference.methods.assets import Index
from coinrag.inference.methods.base import Retrieval, RetrievalRequest
from coinrag.inference.retrieval.retriever import RetrievalResult, Retriever

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine


class IndexSearch(Retrieval):
    """A search of the engine's :class:`~inference.methods.assets.Index` (a ``Retriever``):
    spans of chunks (:class:`~inference.retrieval.retriever.RetrievalResult`), each an evidence
    row."""

    def __call__(self, engine: RagEngine, request: RetrievalRequest) -> RetrievalResult:
        return self.search(engine.asset(Index), request)

    @abstractmethod
    def search(self, index: Retriever, request: RetrievalRequest) -> RetrievalResult:
        """``request``'s evidence from ``index``."""

    def spent_ms(self, found: RetrievalResult) -> float:
        return found.embed_ms + found.search_ms + found.rerank_ms

    def evidence(self, found: RetrievalResult) -> list[dict[str, Any]]:
        """``{doc_id, chunk_id, tok_start, tok_end, text, score}`` per span (``score``: the
        search mode's, :class:`~inference.retrieval.retriever.Evidence`; ``score_parts``: a
        hybrid search's :class:`~inference.retrieval.retriever.ScoreParts`, else None), with
        where it is: the
        ``schemas.tables.PlaceInDocument`` columns (``path``, ``page_first``, ``page_last``,
        ``page_labels``, ``section``) and ``citation`` (``"faq/programming.pdf p. 12 |
        Programming FAQ > Performance"``)."""
        return [
            {
                "doc_id": e.doc_id,
                "chunk_id": e.chunk_id,
                "tok_start": e.tok_start,
                "tok_end": e.tok_end,
                "text": e.text,
                "score": e.score,
                "score_parts": None if e.parts is None else asdict(e.parts),
                **asdict(e.place),
                "citation": e.place.citation(e.doc_id),
            }
            for e in found.evidence
        ]


class TopChunks(IndexSearch):
    """Whole chunks, best first (``Retriever.chunks_only``)."""

    uses_kc = True

    def search(self, index: Retriever, request: RetrievalRequest) -> RetrievalResult:
        return index.chunks_only(
            request.question, kc=request.kc, doc_ids=request.doc_ids, mode=request.mode
        )


class TwoStageNuggets(IndexSearch):
    """CoinRAG's two-stage search (``Retriever.two_stage``): nuggets grouped by chunk rank."""

    uses_kc = True
    uses_k = True

    def search(self, index: Retriever, request: RetrievalRequest) -> RetrievalResult:
        return index.two_stage(
            request.question, kc=request.kc, k=request.k, doc_ids=request.doc_ids, mode=request.mode
        )


class OneStageNuggets(IndexSearch):
    """The one-stage ablation (``Retriever.one_stage``): the top-``k`` nuggets over the whole
    nugget index, no chunk stage (so ``kc`` is not used)."""

    uses_k = True

    def search(self, index: Retriever, request: RetrievalRequest) -> RetrievalResult:
        if request.doc_ids:
            raise ValueError(
                "coinrag-onestage searches the whole nugget index: an oracle document does not "
                "apply to it"
            )
        return index.one_stage(request.question, k=request.k, mode=request.mode)
