"""``standard``: text RAG, no KV reuse: prefill ``prefix ⊕ chunk tokens ⊕ query`` from scratch."""

from __future__ import annotations

from coinrag.inference.generate import prefill_and_decode
from coinrag.inference.methods.assets import ChunkTokenIds, Index
from coinrag.inference.methods.base import Answer, OnToken, RagMethod
from coinrag.inference.methods.retrievals import TopChunks, evidence_rows, retrieval_timings
from coinrag.inference.retrieve import RetrievalResult


class StandardRag(RagMethod, name="standard"):
    """The top-``kc`` chunks' tokens in the prompt (each chunk once, in retrieval order)."""

    needs = (Index, ChunkTokenIds)
    retrieval = TopChunks()

    def run(
        self,
        question: str,
        retrieval: RetrievalResult,
        kc: int,
        k: int,
        on_token: OnToken | None = None,
    ) -> Answer:
        engine = self.engine
        chunk_ids = list(dict.fromkeys(e.chunk_id for e in retrieval.evidence))
        ids = engine.asset(ChunkTokenIds)(chunk_ids)
        context = [ids[c] for c in chunk_ids]
        gen = prefill_and_decode(
            self.loaded.model,
            self.loaded.tokenizer,
            None,
            0,
            engine.prompt.standard_ids(context, question),
            max_new_tokens=engine.max_new_tokens,
            on_token=on_token,
        )
        active = sum(len(c) for c in context)
        timings = retrieval_timings(retrieval)
        return self.finish(
            gen, timings, evidence_rows(retrieval), active, kc, k, mode=retrieval.mode
        )
