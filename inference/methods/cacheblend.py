"""``cacheblend`` and ``cacheblend-v``: TurboRAG's context (the top-``kc`` chunks' stored KV,
re-rotated), then the tokens whose K (LMCache) or V (the CacheBlend paper) deviate most at the
check layer recomputed with the query (``inference.context.blend``). ``ratio`` (0.15) and
``check_layer`` (1) are LMCache's defaults."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

from coinrag.inference.context.blend import (
    DEFAULT_CHECK_LAYER,
    DEFAULT_RATIO,
    Deviation,
    KeyDeviation,
    ValueDeviation,
    blend,
    check_blendable,
)
from coinrag.inference.methods.assets import ChunkTokenIds, Index, StoredChunkKv
from coinrag.inference.methods.base import Turn
from coinrag.inference.methods.turborag import TurboRag
from coinrag.inference.model.encode import causal_lm
from coinrag.inference.model.generate import Generation, Prefilled, decode_greedy

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine


class CacheBlend(TurboRag, name="cacheblend"):
    """Blend with the deviation of the keys after RoPE (LMCache's ``LMCBlender``)."""

    needs = (Index, StoredChunkKv, ChunkTokenIds)
    deviation: ClassVar[Deviation] = KeyDeviation()
    ratio: ClassVar[float] = DEFAULT_RATIO
    check_layer: ClassVar[int] = DEFAULT_CHECK_LAYER

    def __init__(self, engine: RagEngine) -> None:
        super().__init__(engine)
        check_blendable(causal_lm(self.loaded.model).config, self.ratio, self.check_layer)

    def generate(self, turn: Turn) -> tuple[Generation, int]:
        engine, evidence = self.engine, turn.found.evidence
        query_ids, ctx, total = self.query_and_context(turn)
        t0 = time.perf_counter()
        ids = engine.asset(ChunkTokenIds)([e.chunk_id for e in evidence])
        context_ids = [t for e in evidence for t in ids[e.chunk_id][e.tok_start : e.tok_end]]
        turn.timings["kv_load"] += (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        blended = blend(
            self.loaded.model,
            ctx,
            context_ids,
            query_ids,
            ratio=self.ratio,
            check_layer=self.check_layer,
            deviation=self.deviation,
        )
        gen = decode_greedy(
            self.loaded.model,
            self.loaded.tokenizer,
            Prefilled(
                blended.cache,
                blended.first_logits,
                blended.next_position,
                prefill_ms=(time.perf_counter() - t1) * 1000,
            ),
            max_new_tokens=engine.max_new_tokens,
            on_token=turn.on_token,
        )
        return gen, total - engine.prompt.n_prefix


class CacheBlendV(CacheBlend, name="cacheblend-v"):
    """Blend with the deviation of the values (the CacheBlend paper)."""

    deviation = ValueDeviation()
