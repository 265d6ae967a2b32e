"""What the KV-reuse methods share: answer from a context assembled out of stored KV.

``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ...`` is built from the retrieved evidence by the
store's :class:`~inference.context.builders.StoredKvContext` (the builder fine-tuning's ``frozen``
mode uses too), written into the model forward's KV buffer (``inference/model/forward.py``), and
only the query is prefilled after it (``inference.model.generate.prefill_and_decode``). Which spans
(whole chunks or nugget slices) is the subclass's retrieval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from coinrag.inference.context.builders import ContextBuilder
from coinrag.inference.methods.assets import StoredKv, stored_context
from coinrag.inference.methods.base import Asset, RagMethod, Turn
from coinrag.inference.model.generate import Generation, prefill_and_decode

if TYPE_CHECKING:
    import torch


class KvReuseMethod(RagMethod):
    """Prefill only the query after ``C_ctx`` assembled from the store's KV of the evidence.

    ``context``: the asset that builds ``C_ctx`` (the stored KV, re-rotated; an ablation
    places or encodes the spans its own way)."""

    context: ClassVar[type[Asset[ContextBuilder]]] = StoredKv

    def query_and_context(self, turn: Turn) -> tuple[list[int], torch.Tensor, int]:
        """The query's token ids, and ``C_ctx`` of ``turn``'s evidence with its length in
        tokens (prefix included; its KV work added to ``turn.timings``)."""
        query_ids = self.engine.prompt.query_ids(turn.question)
        context = self.engine.asset(self.context)
        ctx, total = stored_context(context, turn.found.evidence, len(query_ids), turn.timings)
        return query_ids, ctx, total

    def generate(self, turn: Turn) -> tuple[Generation, int]:
        query_ids, ctx, total = self.query_and_context(turn)
        gen = prefill_and_decode(  # ctx goes into the forward's KV buffer (in the prefill time)
            self.loaded.model,
            self.loaded.tokenizer,
            ctx,
            total,
            query_ids,
            max_new_tokens=self.engine.max_new_tokens,
            on_token=turn.on_token,
        )
        return gen, total - self.engine.prompt.n_prefix
