"""``turborag``: load whole precomputed chunks' KV, re-rotated to contiguous positions after the
cached prefix ``C_p``; prefill only the query."""

from __future__ import annotations

from coinrag.inference.methods.assets import Index, StoredChunkKv
from coinrag.inference.methods.kv_reuse import KvReuseMethod
from coinrag.inference.methods.retrievals import TopChunks


class TurboRag(KvReuseMethod, name="turborag"):
    """The top-``kc`` chunks, each chunk's stored KV whole."""

    needs = (Index, StoredChunkKv)
    retrieval = TopChunks()
