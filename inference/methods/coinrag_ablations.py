"""CoinRAG's ablations (the paper's Figure 4), each CoinRAG with one part taken away:

- ``coinrag-isolated``: each retrieved nugget's tokens encoded **alone** right after ``C_p``
  (online; no chunk context before it), instead of sliced from its chunk's KV;
- ``coinrag-noalign``: the stored slices keep the positions they were encoded at (no ``Rot``):
  the query still starts at ``T = |p| + Σ n_i``;
- ``coinrag-onestage``: the top-``k`` nuggets of the whole nugget index (no chunk stage; ``kc``
  is not used and is recorded as 0).

The fourth ablation, no fine-tuning, is ``coinrag`` on the base model next to ``coinrag`` on the
fine-tuned one (``coinrag eval --model``, twice).
"""

from __future__ import annotations

from coinrag.inference.methods.assets import (
    Index,
    IsolatedNuggetKv,
    StoredNuggetKv,
    UnalignedNuggetKv,
)
from coinrag.inference.methods.coinrag import CoinRag
from coinrag.inference.methods.retrievals import OneStageNuggets


class CoinRagIsolated(CoinRag, name="coinrag-isolated"):
    """Two-stage retrieval as CoinRAG; each nugget encoded alone after ``C_p`` (its encoding
    counts in ``kv_load``, so in TTFT)."""

    needs = (Index, IsolatedNuggetKv)
    context = IsolatedNuggetKv


class CoinRagNoAlign(CoinRag, name="coinrag-noalign"):
    """Two-stage retrieval as CoinRAG; the stored slices concatenated without re-rotation."""

    needs = (Index, UnalignedNuggetKv)
    context = UnalignedNuggetKv


class CoinRagOneStage(CoinRag, name="coinrag-onestage"):
    """The nuggets' stored slices as CoinRAG, found by one search over every nugget."""

    needs = (Index, StoredNuggetKv)
    retrieval = OneStageNuggets()
