"""``coinrag``: load only the retrieved nugget slices ``C_b[s:e]`` of the top chunks, re-rotated
to contiguous positions after ``C_p`` (``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ...``); prefill
only the query."""

from __future__ import annotations

from coinrag.inference.methods.assets import Index, StoredNuggetKv
from coinrag.inference.methods.kv_reuse import KvReuseMethod
from coinrag.inference.methods.retrievals import TwoStageNuggets


class CoinRag(KvReuseMethod, name="coinrag"):
    """Two-stage retrieval (``kc`` chunks, then ``k`` nuggets inside them), the nuggets' stored
    KV slices."""

    needs = (Index, StoredNuggetKv)
    retrieval = TwoStageNuggets()
