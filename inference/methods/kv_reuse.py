"""What the KV-reuse methods share: answer from a context assembled out of stored KV.

``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ...`` is built from the retrieved evidence by the
store's :class:`~inference.context.StoredKvContext` (the builder fine-tuning's ``frozen`` mode
uses too), written into the model forward's KV buffer (``inference/forward.py``), and only
the query is prefilled after it (``inference.generate.prefill_and_decode``). Which spans
(whole chunks or nugget slices) is the subclass's retrieval.
"""

from __future__ import annotations

from typing import ClassVar

from coinrag.inference.context import ContextBuilder
from coinrag.inference.generate import prefill_and_decode
from coinrag.inference.methods.assets import StoredKv, stored_context
from coinrag.inference.methods.base import Answer, Asset, OnToken, RagMethod
from coinrag.inference.methods.retrievals import evidence_rows, retrieval_timings
from coinrag.inference.retrieve import RetrievalResult


class KvReuseMethod(RagMethod):
    """Prefill only the query after ``C_ctx`` assembled from the store's KV of the evidence.

    ``context``: the asset that builds ``C_ctx`` (the stored KV, re-rotated; an ablation
    places or encodes the spans its own way)."""

    context: ClassVar[type[Asset[ContextBuilder]]] = StoredKv

    def run(
        self,
        question: str,
        retrieval: RetrievalResult,
        kc: int,
        k: int,
        on_token: OnToken | None = None,
    ) -> Answer:
        engine = self.engine
        query_ids = engine.prompt.query_ids(question)
        timings = retrieval_timings(retrieval)
        context = engine.asset(self.context)
        ctx, total = stored_context(context, retrieval.evidence, len(query_ids), timings)
        gen = prefill_and_decode(  # ctx goes into the forward's KV buffer (in the prefill time)
            self.loaded.model,
            self.loaded.tokenizer,
            ctx,
            total,
            query_ids,
            max_new_tokens=engine.max_new_tokens,
            on_token=on_token,
        )
        active = total - engine.prompt.n_prefix
        return self.finish(
            gen, timings, evidence_rows(retrieval), active, kc, k, mode=retrieval.mode
        )
