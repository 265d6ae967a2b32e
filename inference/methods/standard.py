"""``standard``: text RAG, no KV reuse: prefill ``prefix ⊕ chunk tokens ⊕ query`` from scratch."""

from __future__ import annotations

from coinrag.inference.methods.assets import ChunkTokenIds, Index
from coinrag.inference.methods.base import RagMethod, Turn
from coinrag.inference.methods.retrievals import TopChunks
from coinrag.inference.model.generate import Generation, prefill_and_decode


class StandardRag(RagMethod, name="standard"):
    """The top-``kc`` chunks' tokens in the prompt (each chunk once, in retrieval order)."""

    needs = (Index, ChunkTokenIds)
    retrieval = TopChunks()

    def generate(self, turn: Turn) -> tuple[Generation, int]:
        engine = self.engine
        chunk_ids = list(dict.fromkeys(e.chunk_id for e in turn.found.evidence))
        ids = engine.asset(ChunkTokenIds)(chunk_ids)
        context = [ids[c] for c in chunk_ids]
        gen = prefill_and_decode(
            self.loaded.model,
            self.loaded.tokenizer,
            None,
            0,
            engine.prompt.standard_ids(context, turn.question),
            max_new_tokens=engine.max_new_tokens,
            on_token=turn.on_token,
        )
        return gen, sum(len(c) for c in context)
