"""How the chunk and nugget methods retrieve (``inference.retrieve.Retriever`` over the engine's
:class:`~inference.methods.assets.Index`), and the evidence rows their answers carry.

- :class:`TopChunks`: the top-``kc`` chunks, each whole (turborag, standard: one shared result
  per ``kc``);
- :class:`TwoStageNuggets`: the top-``kc`` chunks, then the top-``k`` nuggets inside them
  (coinrag and its isolated / no-alignment ablations);
- :class:`OneStageNuggets`: the top-``k`` nuggets of the whole index (the one-stage ablation).

``doc_ids`` restricts either to those documents' chunks (an oracle's gold documents).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coinrag.inference.methods.assets import Index
from coinrag.inference.methods.base import Retrieval
from coinrag.inference.retrieve import RetrievalResult

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine


class TopChunks(Retrieval):
    """Whole chunks, best first (``Retriever.chunks_only``)."""

    uses_kc = True

    def __call__(
        self,
        engine: RagEngine,
        question: str,
        kc: int,
        k: int,
        doc_ids: Sequence[str] | None,
        mode: str,
    ) -> RetrievalResult:
        return engine.asset(Index).chunks_only(question, kc=kc, doc_ids=doc_ids, mode=mode)


class TwoStageNuggets(Retrieval):
    """CoinRAG's two-stage search (``Retriever.two_stage``): nuggets grouped by chunk rank."""

    uses_kc = True
    uses_k = True

    def __call__(
        self,
        engine: RagEngine,
        question: str,
        kc: int,
        k: int,
        doc_ids: Sequence[str] | None,
        mode: str,
    ) -> RetrievalResult:
        return engine.asset(Index).two_stage(question, kc=kc, k=k, doc_ids=doc_ids, mode=mode)


class OneStageNuggets(Retrieval):
    """The one-stage ablation (``Retriever.one_stage``): the top-``k`` nuggets over the whole
    nugget index, no chunk stage (so ``kc`` is not used)."""

    uses_k = True

    def __call__(
        self,
        engine: RagEngine,
        question: str,
        kc: int,
        k: int,
        doc_ids: Sequence[str] | None,
        mode: str,
    ) -> RetrievalResult:
        if doc_ids:
            raise ValueError(
                "coinrag-onestage searches the whole nugget index: an oracle document does not "
                "apply to it"
            )
        return engine.asset(Index).one_stage(question, k=k, mode=mode)


def retrieval_timings(retrieval: RetrievalResult) -> dict[str, float]:
    """The timings an answer starts with: ``retrieval`` (embedding + search), no KV work yet."""
    return {"retrieval": retrieval.embed_ms + retrieval.search_ms, "kv_load": 0.0, "assembly": 0.0}


def evidence_rows(retrieval: RetrievalResult) -> list[dict[str, Any]]:
    """The answer's evidence: ``{doc_id, chunk_id, tok_start, tok_end, text}`` per span."""
    return [
        {
            "doc_id": e.doc_id,
            "chunk_id": e.chunk_id,
            "tok_start": e.tok_start,
            "tok_end": e.tok_end,
            "text": e.text,
        }
        for e in retrieval.evidence
    ]
